import pytest

from dsflash.runtime.tokenizer import ByteTokenizer, HFTokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(512)
    ids = tok.encode("héllo ✓")
    assert all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == "héllo ✓"
    assert tok.decode([0, 1] + ids + [400]) == "héllo ✓"
    with pytest.raises(ValueError, match="vocab_size=100 is below the 259 byte ids"):
        ByteTokenizer(100)


def test_byte_tokenizer_compression_map():
    m = ByteTokenizer(512).compression_map()
    # upper and lower case ASCII letters merge; partial UTF-8 bytes keep their own ids
    assert m[ord("A") + 3] == m[ord("a") + 3]
    assert m[0xC3 + 3] != m[0xC4 + 3]
    assert m.shape == (512,)


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "Hello": 1, "hello": 2, "world": 3, "World": 4}
    t = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    assert tok.encode("hello World") == [2, 4]
    assert tok.vocab_size == 5
    m = tok.compression_map()
    assert m[1] == m[2] and m[3] == m[4] and m[0] != m[1]
    with pytest.raises(ValueError, match="compresses to 3 ids, the config says 4"):
        tok.compression_map(4)


def test_hf_tokenizer_missing_file_names_its_path(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(FileNotFoundError, match=f"tokenizer file {tmp_path / 'none.json'} does not exist"):
        HFTokenizer(tmp_path / "none.json")

import numpy as np
import pytest
import torch

from dsflash.model.cache import ModelCache
from dsflash.model.model import DSFlashModel, encoder_rows


def test_ids_outside_vocabulary(tiny_model):
    cache = ModelCache.allocate(tiny_model.cfg, 1, 16)
    with pytest.raises(ValueError, match=r"token id 512 outside the vocabulary \[0, 512\)"):
        tiny_model.decoder_step(torch.tensor([[3, 512]]), cache)
    with pytest.raises(ValueError, match=r"token id -1 outside the vocabulary"):
        tiny_model(torch.tensor([[-1, 4]]))
    assert cache.seq_len.tolist() == [0]  # nothing was written


def test_prompt_longer_than_capacity(tiny_model):
    cache = ModelCache.allocate(tiny_model.cfg, 1, 16)
    with pytest.raises(ValueError, match="would reach 17 tokens, over the cache capacity 16"):
        tiny_model.prefill(torch.zeros(1, 17, dtype=torch.long), cache)
    tiny_model.prefill(torch.zeros(1, 16, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="would reach 17 tokens, over the cache capacity 16"):
        tiny_model.decoder_step(torch.zeros(1, 1, dtype=torch.long), cache)


def test_bad_shapes_slots_and_modes(tiny_model):
    cache = ModelCache.allocate(tiny_model.cfg, 2, 16)
    with pytest.raises(ValueError, match=r"ids must be \[batch, rows\]"):
        tiny_model.decoder_step(torch.zeros(3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="ids have batch 1 but 2 slots"):
        tiny_model.decoder_step(torch.zeros(1, 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match=r"slot ids \[2\] outside \[0, 2\)"):
        tiny_model.decoder_step(torch.zeros(1, 1, dtype=torch.long), cache, slots=[2])
    with pytest.raises(ValueError, match="prefill mode 'fast'"):
        tiny_model.prefill(torch.zeros(1, 3, dtype=torch.long), cache, [0], mode="fast")
    # the one split every runtime shares refuses it too (it used to treat it as 'exact')
    with pytest.raises(ValueError, match="prefill mode 'Replay' is not 'replay' or 'exact'"):
        encoder_rows(tiny_model.cfg, 300, "Replay")
    assert encoder_rows(tiny_model.cfg, 300, "exact") == 0
    assert encoder_rows(tiny_model.cfg, 300, "replay") == 300 - tiny_model.cfg.sliding_window
    tiny_model.prefill(torch.zeros(1, 3, dtype=torch.long), cache, [0])
    with pytest.raises(ValueError, match="prefill needs empty slots"):
        tiny_model.prefill(torch.zeros(1, 3, dtype=torch.long), cache, [0])
    with pytest.raises(ValueError, match="capacity=0 must be in"):
        ModelCache.allocate(tiny_model.cfg, 1, 0)


def test_bad_vocab_map(tiny_cfg):
    with pytest.raises(ValueError, match=r"vocab_map has shape \(3,\), expected \(512,\)"):
        DSFlashModel(tiny_cfg, vocab_map=np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="outside \\[0, engram_compressed_vocab_size=256\\)"):
        DSFlashModel(tiny_cfg, vocab_map=np.full(512, 300, dtype=np.int64))


def test_counts_must_be_whole_numbers(tiny_model):
    from dsflash.runtime.cache_manager import CacheManager
    from dsflash.runtime.request import GenerationParams

    cfg = tiny_model.cfg
    with pytest.raises(TypeError, match="slots=2.5 must be an int, not float"):
        CacheManager(cfg, 2.5, 16)
    with pytest.raises(ValueError, match="slots=0 must be > 0"):
        CacheManager(cfg, 0, 16)
    with pytest.raises(TypeError, match="capacity=16.0 must be an int, not float"):
        ModelCache.allocate(cfg, 1, 16.0)
    with pytest.raises(TypeError, match="batch=True must be an int, not bool"):
        ModelCache.allocate(cfg, True, 16)
    with pytest.raises(TypeError, match="max_new_tokens=4.0 must be an int, not float"):
        GenerationParams(max_new_tokens=4.0)
    cm = CacheManager(cfg, np.int64(2), np.int32(16))  # numpy integers are whole numbers
    assert cm.slots == 2 and cm.cache.capacity == 16


def test_stop_conditions_are_sequences():
    from dsflash.runtime.request import GenerationParams

    # a bare str would stop on each of its characters; "" would stop before the first token
    with pytest.raises(TypeError, match="stop_strings='ab' must be a sequence of non-empty str"):
        GenerationParams(stop_strings="ab")
    with pytest.raises(TypeError, match="must be a sequence of non-empty str"):
        GenerationParams(stop_strings=["ab", ""])
    with pytest.raises(TypeError, match="stop_token_ids=5 must be a sequence of token ids"):
        GenerationParams(stop_token_ids=5)
    with pytest.raises(TypeError, match=r"stop_token_ids\[\]=1.5 must be an int"):
        GenerationParams(stop_token_ids=[1.5])
    params = GenerationParams(stop_token_ids=[np.int64(2), 7], stop_strings=["\n\n"])
    assert params.stop_token_ids == (2, 7) and params.stop_strings == ("\n\n",)
    hash(params)  # lists were frozen into tuples: the params stay hashable

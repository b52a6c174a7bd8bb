"""Custom ops: per op a reference (the spec), a declaration, and its backends."""

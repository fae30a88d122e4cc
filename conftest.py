# Makes `examples.llama` importable from the tests (the repository root goes on sys.path).

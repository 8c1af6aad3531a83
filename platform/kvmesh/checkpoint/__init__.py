"""Local model files (no torch at import): the embedded default model, packaged models by name,
GGUF -> HF folder conversion into the cache, checkpoint folders, fingerprints and tokenizers."""

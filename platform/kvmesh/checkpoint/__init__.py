"""Local model files (no torch at import): the embedded default model, checkpoint folders,
fingerprints and tokenizers."""

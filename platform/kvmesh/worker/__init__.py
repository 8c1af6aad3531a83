"""Everything that touches tensors: model runner, attention backends, sampler."""

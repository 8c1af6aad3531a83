"""Model building blocks on paged KV: attention backends (PyTorch reference, C++ on CPU),
fused element-wise ops, linear layers and the CPU kernels they dispatch to."""

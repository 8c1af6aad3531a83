"""Engine bookkeeping: requests, block pool, KV cache manager, scheduler.

Nothing in this package imports torch at module level; the tensor work lives in
`kvmesh.worker`, reached only through `LLMEngine`.
"""

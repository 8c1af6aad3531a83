import subprocess
import sys

from kvmesh.engine.hashing import block_hashes, hash_block, root_hash


def test_chain_depends_on_prefix_and_fingerprint():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2, "m1")
    assert len(a) == 3  # only full blocks
    b = block_hashes([9, 2, 3, 4, 5, 6], 2, "m1")
    # same tokens in block 1 but a different parent: every later hash differs
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    c = block_hashes([1, 2, 3, 4, 5, 6], 2, "m2")
    assert set(a).isdisjoint(c)
    assert a[1] == hash_block(hash_block(root_hash("m1"), [1, 2]), [3, 4])


def test_incremental_equals_full():
    toks = list(range(40))
    part = block_hashes(toks[:17], 4, "fp")
    assert block_hashes(toks, 4, "fp", part) == block_hashes(toks, 4, "fp")


def test_deterministic_across_processes():
    code = "from kvmesh.engine.hashing import block_hashes; print(block_hashes(list(range(64)), 16, 'fp')[-1].hex())"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("1", "2")}
    assert runs == {block_hashes(list(range(64)), 16, "fp")[-1].hex() + "\n"}


def test_bookkeeping_imports_no_torch():
    code = (
        "import sys\n"
        "import kvmesh.engine.scheduler, kvmesh.engine.kv_cache_manager, kvmesh.engine.block_pool\n"
        "import kvmesh.engine.hashing, kvmesh.engine.detokenizer, kvmesh.engine.outputs\n"
        "assert 'torch' not in sys.modules, 'bookkeeping imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""Hand-made traces the simulator tests share."""

from kvmesh.sim.trace import TraceRequest


def conversations(n_conv: int = 11, turns: int = 6) -> list[TraceRequest]:
    """Turn k of a conversation repeats its k earlier blocks and adds one; turns of all
    conversations interleave, one request a second. With 11 conversations (prime to the
    router counts used) a conversation's turns reach different router replicas."""
    out = []
    for k in range(turns):
        for c in range(n_conv):
            ids = tuple(1000 * c + j for j in range(k + 1))
            out.append(TraceRequest(float(len(out)), len(ids) * 512, 4, ids))
    return out

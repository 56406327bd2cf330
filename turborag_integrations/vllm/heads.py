"""Which of a blob's KV heads one tensor-parallel rank holds.

A blob stores every KV head of a layer. Under tensor parallelism vLLM splits the KV heads across
ranks when there are at least as many as ranks (rank r holds heads r·h … r·h + h − 1, h = heads /
ranks), and replicates them otherwise (each rank holds one head, shared by ranks / heads ranks).
"""

from __future__ import annotations


def rank_heads(total: int, local: int, rank: int, world: int) -> slice:
    """The slice of a blob's `total` heads that rank `rank` of `world` holds as `local` heads."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world} ranks")
    if local == total:
        return slice(0, total)
    if total >= world and total % world == 0 and local == total // world:
        return slice(rank * local, (rank + 1) * local)
    if local == 1 and world > total and world % total == 0:
        head = rank // (world // total)
        return slice(head, head + 1)
    raise ValueError(f"a blob of {total} KV heads does not split into {local} per rank over "
                     f"{world} ranks: it was made for another model")

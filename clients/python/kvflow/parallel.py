"""Which layers and KV heads a rank holds: vLLM's rules, as kvflow's planner
(stages/plan: PPIndices, HeadSourceFor, Config.Shape) applies them."""

__all__ = ["pp_indices", "parse_partition", "kv_heads_per_rank", "kv_head_start", "PartitionError"]


class PartitionError(ValueError):
    """A bad VLLM_PP_LAYER_PARTITION, or PP ranks out of range."""


def parse_partition(s, num_layers, pp_size, field="pp_layer_partition"):
    """VLLM_PP_LAYER_PARTITION as vLLM parses it ([int(x) for x in
    s.split(",")], one count per stage summing to num_layers). None or ""
    is unset (returns None)."""
    if s is None or s == "":
        return None
    try:
        parts = [int(x) for x in str(s).split(",")]
    except ValueError:
        raise PartitionError("%s: invalid partition string %r" % (field, s)) from None
    if any(p < 0 for p in parts):
        raise PartitionError("%s: negative layer count in %r" % (field, s))
    if len(parts) != pp_size:
        raise PartitionError("%s: %d partitions in %r do not match pp_size %d" % (field, len(parts), s, pp_size))
    if sum(parts) != num_layers:
        raise PartitionError("%s: partitions in %r sum to %d, not num_hidden_layers %d"
                             % (field, s, sum(parts), num_layers))
    return parts


def pp_indices(num_layers, pp_rank, pp_size, partition=None):
    """vLLM's get_pp_indices: the [start, end) layers of PP stage pp_rank.
    partition is VLLM_PP_LAYER_PARTITION (None or "" for unset); without it
    layers split evenly and the remainder goes one each to the stages just
    before the last."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise PartitionError("pp_rank %d outside [0, pp_size %d)" % (pp_rank, pp_size))
    parts = parse_partition(partition, num_layers, pp_size)
    if parts is None:
        parts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def kv_heads_per_rank(total, tp):
    """KV heads each TP rank holds: max(1, total // tp) (vLLM replicates a
    head over tp // total ranks when tp > total)."""
    return max(1, total // tp)


def kv_head_start(total, tp, rank):
    """The first KV head TP rank rank holds: rank * total // tp, or, when
    heads are replicated (tp > total), head rank // (tp // total)."""
    if tp > total:
        return rank // (tp // total)
    return rank * (total // tp)

"""kvflow.parallel: vLLM's layer and head placement rules, as kvflow's
planner applies them (stages/plan PPIndices, HeadSourceFor)."""

import unittest

import _util  # noqa: F401 - kvflow on sys.path

from kvflow.parallel import PartitionError, kv_head_start, kv_heads_per_rank, pp_indices


class ParallelTest(unittest.TestCase):
    def test_pp_indices(self):
        cases = [
            # (layers, pp, partition, per-stage [start, end)), vLLM's get_pp_indices
            (4, 1, None, [(0, 4)]),
            (4, 2, None, [(0, 2), (2, 4)]),
            (3, 2, None, [(0, 2), (2, 3)]),             # the remainder goes to the stage before the last
            (10, 4, None, [(0, 2), (2, 5), (5, 8), (8, 10)]),
            (3, 2, "1,2", [(0, 1), (1, 3)]),
            (3, 2, " 2 , 1", [(0, 2), (2, 3)]),         # int() strips spaces
            (4, 2, "", [(0, 2), (2, 4)]),               # "" is unset
        ]
        for layers, pp, part, want in cases:
            with self.subTest(layers=layers, pp=pp, part=part):
                self.assertEqual([pp_indices(layers, s, pp, part) for s in range(pp)], want)

    def test_pp_indices_rejects(self):
        cases = [
            ((3, 2, 2, None), "pp_rank 2 outside \\[0, pp_size 2\\)"),
            ((3, 0, 2, "1,1"), "sum to 2, not num_hidden_layers 3"),
            ((3, 0, 2, "3"), "1 partitions in '3' do not match pp_size 2"),
            ((3, 0, 2, "a,3"), "invalid partition string 'a,3'"),
            ((3, 0, 2, "-1,4"), "negative layer count"),
        ]
        for args, want in cases:
            with self.subTest(args=args):
                with self.assertRaisesRegex(PartitionError, want):
                    pp_indices(*args)

    def test_kv_heads(self):
        cases = [
            # (kv heads, tp, per-rank count, first head of each rank)
            (4, 1, 4, [0]),
            (4, 2, 2, [0, 2]),
            (4, 4, 1, [0, 1, 2, 3]),
            (2, 4, 1, [0, 0, 1, 1]),          # replicated: rank r holds head r // (tp // heads)
            (1, 4, 1, [0, 0, 0, 0]),
            (2, 8, 1, [0, 0, 0, 0, 1, 1, 1, 1]),
        ]
        for heads, tp, per, starts in cases:
            with self.subTest(heads=heads, tp=tp):
                self.assertEqual(kv_heads_per_rank(heads, tp), per)
                self.assertEqual([kv_head_start(heads, tp, r) for r in range(tp)], starts)


if __name__ == "__main__":
    unittest.main()

from turborag_integrations.vllm.heads import rank_heads

import pytest


def test_one_rank_holds_every_head():
    assert rank_heads(8, 8, 0, 1) == slice(0, 8)


def test_heads_split_across_ranks_in_order():
    assert [rank_heads(8, 2, r, 4) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6),
                                                          slice(6, 8)]


def test_fewer_heads_than_ranks_are_replicated():
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    assert [rank_heads(2, 1, r, 4) for r in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2),
                                                          slice(1, 2)]


def test_a_blob_of_another_shape_is_refused():
    with pytest.raises(ValueError, match="another model"):
        rank_heads(6, 4, 0, 2)

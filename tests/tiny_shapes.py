"""Random tiny DeepSeek-V4 shapes (`make_tiny` overrides) for tests that sweep many configs."""

from __future__ import annotations

import random
from typing import Any


def random_shape(rng: random.Random, index_n_heads: int = 2) -> dict[str, Any]:
    """A small random config with at least one ratio-4 (indexer) layer and a 512-token vocabulary.

    Two index heads by default: indexer scores then tie exactly (at 0) often, which is what the
    engine's tie rule is for.
    """
    layers = rng.randint(2, 4)
    hca = rng.choice((8, 16))
    ratios = [rng.choice((0, 4, 4, hca)) for _ in range(layers)]
    if 4 not in ratios:
        ratios[rng.randrange(layers)] = 4
    return {
        "vocab_size": 512,
        "num_hidden_layers": layers,
        "compress_ratios": ratios,
        "hidden_size": rng.choice((32, 48, 64)),
        "num_attention_heads": rng.choice((2, 4)),
        "o_groups": rng.choice((1, 2)),
        "sliding_window": rng.choice((4, 8, 12)),
        "index_topk": rng.choice((2, 3, 4)),
        "index_n_heads": index_n_heads,
        "num_hash_layers": rng.randint(0, min(2, layers)),
        "n_routed_experts": rng.choice((4, 8)),
    }

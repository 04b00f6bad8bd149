"""The model's parameters are the protocol's components, with the sizes compute_block_sizes says."""

from __future__ import annotations

import pytest
import torch

from gradserver.common import compute_block_sizes
from gradserver.common.components import BlockComponent, NonBlockComponent
from gradserver.train.corpus import VOCAB_SIZE, TokenWindows, corpus_bytes, decode, encode
from gradserver.train.model import CONFIGS, TransformerBlock, TransformerLM


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_sizes_match_real_parameter_shapes(name: str) -> None:
    cfg = CONFIGS[name]
    block = TransformerBlock(cfg)
    names = [n for n, _ in block.named_parameters()]
    assert names == [c.name.lower() for c in BlockComponent]
    sizes = tuple(p.numel() for p in block.components())
    assert sizes == compute_block_sizes(cfg.hidden, cfg.kv_hidden, cfg.intermediate)


def test_350m_sizes() -> None:
    cfg = CONFIGS["350m"]
    assert (cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate, cfg.num_layers, cfg.vocab) == (
        1024,
        16,
        4,
        4096,
        24,
        32768,
    )
    assert cfg.kv_hidden == 256 and sum(compute_block_sizes(1024, 256, 4096)) == 15_206_400


def test_non_block_parameters_and_tying() -> None:
    untied = TransformerLM(CONFIGS["tiny"])
    assert set(untied.non_block_parameters()) == set(NonBlockComponent)
    tied = TransformerLM(dataclass_replace(CONFIGS["tiny"], tied=True))
    assert NonBlockComponent.LM_HEAD not in tied.non_block_parameters()
    tokens = torch.randint(0, 256, (2, 16))
    assert tied(tokens).shape == (2, 16, 256)


def test_same_seed_same_weights() -> None:
    a, b = TransformerLM(CONFIGS["tiny"], seed=3), TransformerLM(CONFIGS["tiny"], seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_corpus_is_shipped_and_byte_tokenized() -> None:
    data = corpus_bytes()
    assert len(data) > 3_000_000 and data.startswith(b"In the beginning")
    assert decode(encode("héllo")) == "héllo" and int(encode("A")[0]) < VOCAB_SIZE
    windows = TokenWindows(data, 32)
    x, y = windows.batch([0, 5])
    assert x.shape == y.shape == (2, 32) and torch.equal(x[0, 1:], y[0, :-1])


def dataclass_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)

"""The teacher's slab loop against a dense reference: every block's slabs are the full logits' pieces, in order."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from kdflow.tasks.common.float32_logits import Float32Logits
from kdflow.tasks.common.models import LogitTransform
from kdflow.tasks.teacher.slab import TeacherSlabs, head_vocab_size, split_logsumexp_

HIDDEN, VOCAB = 24, 203  # a prime vocabulary: no slab width divides it


class _Block:
    def __init__(self) -> None:
        self.slabs: list[tuple[int, Tensor]] = []

    def add(self, logits: Tensor, first_id: int) -> None:
        self.slabs.append((first_id, logits.clone()))  # the loop may reuse the buffer for the next slab
        logits.fill_(float("nan"))  # a block may overwrite its slab: nothing after it may read it


class _Recorder:
    """A `SlabTargets` that keeps what it is handed: (start, stop, [(first id, logits)]) per block."""

    def __init__(self) -> None:
        self.blocks: list[tuple[int, int, list[tuple[int, Tensor]]]] = []

    def block(self, start: int, stop: int) -> _Block:
        return _Block()

    def gather(self, block: _Block, start: int, stop: int) -> None:
        self.blocks.append((start, stop, block.slabs))


def _head(seed: int, bias: bool = True) -> nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(VOCAB, generator=generator))
    return head


def _dense(hidden: Tensor, head: nn.Linear) -> Tensor:
    """float64 logits (N, V) of the whole micro-batch at once."""
    logits = hidden.double() @ head.weight.double().T
    return logits if head.bias is None else logits + head.bias.double()


def _reassemble(recorder: _Recorder, n_tokens: int, chunk_tokens: int, cols: int) -> Tensor:
    """The recorded slabs put back into (N, V), checking that blocks and slabs tile it in order."""
    out = torch.full((n_tokens, VOCAB), float("nan"), dtype=torch.float64)
    assert [(start, stop) for start, stop, _ in recorder.blocks] == [
        (start, min(start + chunk_tokens, n_tokens)) for start in range(0, n_tokens, chunk_tokens)]
    for start, stop, slabs in recorder.blocks:
        assert [first for first, _ in slabs] == list(range(0, VOCAB, cols))
        for first, logits in slabs:
            assert logits.dtype == torch.float32 and logits.shape == (stop - start, min(cols, VOCAB - first))
            out[start:stop, first : first + logits.shape[1]] = logits.double()
    return out


@pytest.mark.parametrize(("n_tokens", "chunk_tokens", "vocab_chunk"),
                         [(37, 8, 50), (37, 37, None), (5, 64, 1), (1, 1, VOCAB), (40, 7, 202), (0, 4, 9)])
@pytest.mark.parametrize("bias", [True, False])
def test_blocks_and_slabs_tile_the_dense_logits(n_tokens: int, chunk_tokens: int, vocab_chunk: int | None,
                                                bias: bool) -> None:
    """Ragged last blocks and slabs, one-id slabs, one-row blocks, an empty input."""
    head = _head(0, bias)
    hidden = torch.randn(n_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    slabs = TeacherSlabs(hidden, head, chunk_tokens, vocab_chunk=vocab_chunk)
    assert slabs.vocab_size == VOCAB and slabs.cols == min(vocab_chunk or VOCAB, VOCAB)
    recorder = _Recorder()
    slabs.run(recorder)
    got = _reassemble(recorder, n_tokens, slabs.rows, slabs.cols)
    torch.testing.assert_close(got, _dense(hidden, head), atol=1e-5, rtol=1e-5)


def test_the_transform_and_a_float32_output_head_apply_to_every_slab() -> None:
    bf16 = _head(2).to(torch.bfloat16)
    hidden = torch.randn(19, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    transform = LogitTransform(scale=0.5, softcap=2.0)
    recorder = _Recorder()
    TeacherSlabs(hidden, Float32Logits(bf16), 6, vocab_chunk=31).run(recorder, transform)
    dense = torch.tanh(_dense(hidden, bf16) * 0.5 / 2.0) * 2.0  # float32 logits: no rounding to bf16
    torch.testing.assert_close(_reassemble(recorder, 19, 6, 31), dense, atol=1e-5, rtol=1e-5)


def test_a_module_head_is_called_whole_and_cannot_be_cut() -> None:
    head = nn.Sequential(_head(4))
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5))
    assert head_vocab_size(head, hidden) == VOCAB  # one probe row
    recorder = _Recorder()
    TeacherSlabs(hidden, head, 4).run(recorder)
    torch.testing.assert_close(_reassemble(recorder, 9, 4, VOCAB), _dense(hidden, head[0]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="vocab_chunk needs a plain weight"):
        TeacherSlabs(hidden, head, 4, vocab_chunk=100).run(_Recorder())


@pytest.mark.parametrize(("chunk_tokens", "vocab_chunk", "message"),
                         [(0, None, "chunk_tokens must be"), (4, 0, "vocab_chunk must be")])
def test_bad_sizes_are_named(chunk_tokens: int, vocab_chunk: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TeacherSlabs(torch.zeros(3, HIDDEN), _head(6), chunk_tokens, vocab_chunk=vocab_chunk)
    with pytest.raises(ValueError, match="hidden must be"):
        TeacherSlabs(torch.zeros(3, 2, HIDDEN), _head(6), 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kept", [0, 1, 6, 33])
def test_split_logsumexp_is_the_dense_full_and_complement_logsumexp(dtype: torch.dtype, kept: int) -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(11, 33, generator=generator) * 8  # peaked rows: tails down to ~1e-10
    logits[2, 5:] = -torch.inf  # a row with only 5 finite logits
    cols = torch.rand(11, 33, generator=generator).argsort(1)[:, :kept]  # (c, kept) distinct columns
    in_place = dtype == torch.float32
    exp = logits.clone() if in_place else torch.empty(11, 33, dtype=dtype)
    lse, rest = split_logsumexp_(exp if in_place else logits, cols, exp=exp)
    reference = logits.double()
    torch.testing.assert_close(lse.double(), reference.logsumexp(1), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(rest.double(), reference.scatter(1, cols, -torch.inf).logsumexp(1),
                               atol=1e-5, rtol=1e-6)
    assert lse.dtype == dtype and rest.dtype == dtype
    if kept == 33:
        assert torch.isneginf(rest).all()
    # A row max handed in (a sorted top-k's first column) gives the same answer.
    exp = logits.clone().to(dtype)
    given = split_logsumexp_(exp, cols, exp=exp, row_max=logits.amax(1).to(dtype))
    torch.testing.assert_close(given[0], lse)
    torch.testing.assert_close(given[1], rest)

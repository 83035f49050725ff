"""The dry run that finds each checkpoint tensor's kept part (DRY-RUN CONTRACT of
``tpusync.sglang.weight_slices``): the parts a loader reads, the tensors it cannot tell, the
parameters a load leaves unwritten (COVERAGE RULE), and a model that is the same objects and
bytes afterwards. The live TP=2 servers of
``test_weight_sync_server.py`` run it on SGLang's own models."""

from __future__ import annotations

import pytest
import torch

from tpusync.rl.layout import Box
from tpusync.sglang.weight_slices import DryRunError, kept_boxes, view_box


class RankOneOfTwo(torch.nn.Module):
    """Loads like tensor-parallel rank 1 of 2 would, in the ways SGLang's loaders write."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.cast = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.register_buffer("scale", torch.zeros(2))

    def load_weights(self, weights):
        for name, w in weights:
            if name == "q":  # rows 2:4 of a (4, 4) q into the stacked parameter
                self.qkv.data[0:2].copy_(w.narrow(0, 2, 2))
            elif name == "k":  # rows 1:2 of a (2, 4) k, by item assignment
                self.qkv.data[2:3] = w[1:2]
            elif name == "v":  # the same rows again, twice: one box
                self.qkv.data[3:4].copy_(w.narrow(0, 1, 1))
                self.qkv.data[4:5].copy_(w[1])
            elif name == "o":  # columns 2:4 of a row-parallel (4, 4)
                self.o.data.copy_(w.narrow(1, 2, 2))
            elif name == "norm":
                self.norm.data.copy_(w)
                self.scale.fill_(1.0)  # a write that is not a copy of a checkpoint tensor
            elif name == "cast":  # a new tensor made of it: what reaches the model is not a part
                self.cast.data.copy_(w.to(torch.float64)[0:2])
            elif name == "flat":  # a view that is not a box
                self.qkv.data[5, 0:2].copy_(w.view(-1)[2:4])  # (0, 2) and (1, 0)
            elif name == "rebound":
                self.norm = torch.nn.Parameter(w, requires_grad=False)


SHAPES = {
    "q": (4, 4),
    "k": (2, 4),
    "v": (2, 4),
    "o": (4, 4),
    "norm": (4,),
    "cast": (4, 4),
    "flat": (2, 3),
    "rebound": (4,),
    "ignored": (3,),
}


def test_the_dry_run_finds_each_part_a_loader_reads_and_writes_nothing():
    model = RankOneOfTwo()
    before = {n: (t, t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()}
    boxes, whole, unwritten = kept_boxes(model, SHAPES, torch.float32)
    assert boxes["q"] == Box((2, 0), (4, 4))
    assert boxes["k"] == Box((1, 0), (2, 4))
    assert boxes["v"] == Box((1, 0), (2, 4))
    assert boxes["o"] == Box((0, 2), (4, 4))
    assert boxes["norm"] == Box((0,), (4,))
    assert set(whole) == {"cast", "flat", "rebound", "ignored"}
    assert all(boxes[n] is None for n in whole)
    assert whole["cast"] == "to made a new tensor of it"
    assert whole["flat"] == "it was copied from a view that is not a box"
    assert whole["ignored"] == "load_weights did not copy it"
    # Row 5 of qkv gets only columns 0:2 ("flat"); every other parameter is written whole
    # ("norm" by a copy and by being rebound, "cast" from a new tensor, "o" by one copy).
    assert unwritten == {"qkv": "22 of its 24 elements (6, 4)"}
    after = model.state_dict(keep_vars=True)
    assert set(after) == set(before)
    for n, (obj, data) in before.items():
        assert after[n] is obj, n  # the rebound parameter was put back
        assert after[n].device.type == "cpu" and torch.equal(after[n], data), n


def test_a_loader_that_raises_on_the_shapes_is_a_dry_run_error_and_writes_nothing():
    class Refuses(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2), requires_grad=False)

        def load_weights(self, weights):
            for name, w in weights:
                assert name == "w", f"{name} {tuple(w.shape)}"  # a name the model does not know
                self.w.data.copy_(w)  # skipped by the dry run
                self.w = torch.nn.Parameter(w, requires_grad=False)  # put back by the dry run

    model = Refuses()
    w = model.w
    with pytest.raises(
        DryRunError, match=r"(?s)AssertionError after 'x': x \(3,\).*does the trainer"
    ):
        kept_boxes(model, {"w": (2,), "x": (3,)}, torch.float32)
    assert model.w is w and torch.equal(model.w, torch.ones(2))  # SHAPE CHECK RULE: untouched


class Vocab(torch.nn.Module):
    """A vocabulary shard padded past the checkpoint's rows, a tied head, and a parameter only a
    tensor the trainer may leave out writes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.ones(8, 2), requires_grad=False)
        self.head = self.embed  # tied: one parameter, listed once
        self.gate = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(2), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "embed":  # rows 0:5 copied, the padding rows 5:8 zeroed
                self.embed[: w.shape[0]].data.copy_(w)
                self.embed[w.shape[0] :].data.fill_(0)
            elif name == "gate":  # advanced indexing: not placed as a box, so counted whole
                self.gate.data[torch.tensor([0, 2])] = w[0:2]
            elif name == "bias":  # only the first half
                self.bias.data.narrow(0, 0, 2).copy_(w)
            elif name == "norm":
                self.norm.data.copy_(w)


def test_the_dry_run_lists_the_parameters_a_load_leaves_unwritten():
    model = Vocab()
    shapes = {"embed": (5, 2), "gate": (2, 2), "bias": (2,), "norm": (2,)}
    assert kept_boxes(model, shapes, torch.float32).unwritten == {
        "bias": "2 of its 4 elements (4,)"
    }
    del shapes["norm"]  # the trainer leaves a tensor out: its parameter keeps the old values
    assert kept_boxes(model, shapes, torch.float32).unwritten == {
        "bias": "2 of its 4 elements (4,)",
        "norm": "all of (2,)",
    }
    assert torch.equal(model.embed, torch.ones(8, 2))  # nothing written, nothing filled


@pytest.mark.parametrize(
    "make, box",
    [
        (lambda t: t, Box((0, 0, 0), (2, 3, 4))),
        (lambda t: t[1], Box((1, 0, 0), (2, 3, 4))),
        (lambda t: t[:, 1:3, 2:4], Box((0, 1, 2), (2, 3, 4))),
        (lambda t: t.narrow(2, 1, 1), Box((0, 0, 1), (2, 3, 2))),
        (lambda t: t.transpose(0, 2), Box((0, 0, 0), (2, 3, 4))),  # the same elements
        (lambda t: t[0, 2, 3], Box((0, 2, 3), (1, 3, 4))),
        (lambda t: t.view(-1)[4:12], None),  # rows 1 and 2 of t[0] flattened: not a box
        (lambda t: t[:, ::2], None),  # every other row: not a box
        (lambda t: t[:, 0:0], None),  # nothing
    ],
)
def test_view_box(make, box):
    base = torch.empty(2, 3, 4, device="meta")
    assert view_box(make(base), (2, 3, 4)) == box

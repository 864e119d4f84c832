"""Naming a row's storages: every tensor's storage once, under the first category that holds it."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lightning_memtrace.capture.categories import CategoryCounter, NamedStorages
from lightning_memtrace.types import Category


def _trained_linear() -> tuple[nn.Linear, torch.optim.Optimizer]:
    model = nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_model_states_are_named_once_each_with_their_bytes():
    model, optimizer = _trained_linear()
    counter = CategoryCounter(torch.device("cpu"), model, [optimizer])
    totals = counter.name().totals
    assert totals[Category.PARAMETERS] == (16 * 8 + 8) * 4
    assert totals[Category.GRADIENTS] == (16 * 8 + 8) * 4
    # AdamW: exp_avg and exp_avg_sq per parameter (fp32) and a float32 step scalar each
    assert totals[Category.OPTIMIZER_STATE] == 2 * (16 * 8 + 8) * 4 + 2 * 4
    assert totals[Category.ACTIVATIONS] == totals[Category.INPUTS] == 0


def test_a_storage_held_twice_counts_once_under_the_first_category():
    model, optimizer = _trained_linear()
    counter = CategoryCounter(torch.device("cpu"), model, [optimizer])
    # the optimizer's state also points at the weight (a view of it): still a parameter, counted once
    optimizer.state[model.weight]["alias"] = model.weight.detach()[:2]
    named = counter.name()
    assert named.storages[model.weight.untyped_storage()._cdata][0] is Category.PARAMETERS
    assert named.totals[Category.OPTIMIZER_STATE] == 2 * (16 * 8 + 8) * 4 + 2 * 4


def test_a_sparse_tensor_is_named_by_its_indices_and_values():
    counter = CategoryCounter(torch.device("cpu"))
    plain = torch.zeros(10)
    coo = torch.eye(3).to_sparse()  # no storage of its own: a 2x3 int64 index and 3 float values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        # 5 row pointers and 4 column indices (int64), 4 values
        csr = torch.sparse_csr_tensor(torch.arange(5), torch.arange(4), torch.ones(4), (4, 4))
    named = NamedStorages()
    counter._collect([plain, coo, csr], named, Category.GRADIENTS)
    assert len(named.storages) == 1 + 2 + 3
    assert coo._values().untyped_storage()._cdata in named.storages
    assert named.totals[Category.GRADIENTS] == 40 + (6 * 8 + 3 * 4) + (5 * 8 + 4 * 8 + 4 * 4)


def test_tensors_without_a_plain_storage_are_skipped_and_the_rest_still_named():
    counter = CategoryCounter(torch.device("cpu"))
    plain = torch.zeros(10)
    opaque = torch.zeros(3).to_mkldnn()  # a CPU tensor whose storage cannot be read, nor any parts of it
    meta = torch.empty(100, device="meta")  # another device
    other = torch.zeros(3, dtype=torch.float64)
    for tensors in ([plain, opaque, plain[2:]], [plain, meta, plain[2:]]):
        named = NamedStorages()
        counter._collect(tensors, named, Category.OPTIMIZER_STATE)
        assert list(named.storages) == [plain.untyped_storage()._cdata]
        assert named.totals == {**dict.fromkeys(Category, 0), Category.OPTIMIZER_STATE: 40}
    named = NamedStorages()
    counter._collect(iter([other, plain]), named, Category.INPUTS)  # any iterable, first seen first
    assert list(named.storages) == [other.untyped_storage()._cdata, plain.untyped_storage()._cdata]
    assert named.totals[Category.INPUTS] == 24 + 40
    assert NamedStorages().totals == {category: 0 for category in Category}


def test_saved_and_input_storages_named_already_keep_their_first_category_and_count_there_only():
    model, optimizer = _trained_linear()
    counter = CategoryCounter(torch.device("cpu"), model, [optimizer])
    batch = torch.randn(4, 16)
    activation = torch.randn(4, 8)
    storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in (model.weight, batch, activation)}
    named = counter.name(inputs={batch.untyped_storage()._cdata: batch.untyped_storage()}, saved=storages)
    assert named.storages[model.weight.untyped_storage()._cdata][0] is Category.PARAMETERS
    assert named.storages[batch.untyped_storage()._cdata][0] is Category.INPUTS
    assert named.totals[Category.PARAMETERS] == (16 * 8 + 8) * 4
    assert named.totals[Category.INPUTS] == 4 * 16 * 4
    assert named.totals[Category.ACTIVATIONS] == 4 * 8 * 4  # the weight and the batch are not counted again
    # each category's bytes are those of the storages named under it, each storage once
    for category in Category:
        named_here = [st for cat, st in named.storages.values() if cat is category]
        assert named.totals[category] == sum(st.nbytes() for st in named_here)
    # weight and bias, their grads, AdamW's exp_avg, exp_avg_sq and step for each, the batch, the activation
    assert len(named.storages) == 2 + 2 + 3 * 2 + 1 + 1

"""pargrad.nn: Module's registration, naming, modes and state_dict; the layers against
numpy formulas and finite differences; their initial distributions; and, when PyTorch is
installed, the same model in torch.nn with copied weights."""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import nn
from pargrad.nn import functional as F


class Net(nn.Module):
    """Submodules registered before a parameter of its own, and a container."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2, bias=False))
        self.scale = nn.Parameter(pargrad.ones(2))

    def forward(self, x: Any) -> pargrad.Tensor:
        return self.layers(pargrad.relu(self.embed(x))) * self.scale


@contextmanager
def parameters_replaced(model: nn.Module, values: list[pargrad.Tensor]) -> Iterator[None]:
    """``model`` computing with ``values`` (gradcheck's own leaves) in place of its
    parameters, in ``named_parameters`` order."""
    modules = dict(model.named_modules())
    slots = []
    for name, _ in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        slots.append((modules[prefix]._parameters, leaf))
    saved = [store[leaf] for store, leaf in slots]
    try:
        for (store, leaf), value in zip(slots, values):
            store[leaf] = value  # type: ignore[assignment]
        yield
    finally:
        for (store, leaf), param in zip(slots, saved):
            store[leaf] = param


# ----- registration and naming -----
def test_named_parameters_own_first_then_submodules_in_registration_order() -> None:
    net = Net()
    assert [name for name, _ in net.named_parameters()] == [
        "scale", "embed.weight", "embed.bias", "layers.0.weight", "layers.0.bias",
        "layers.2.weight"]
    assert [p.shape for p in net.parameters()] == [(2,), (4, 3), (4,), (4, 4), (4,), (2, 4)]
    assert [name for name, _ in net.named_parameters(recurse=False)] == ["scale"]
    assert [name for name, _ in net.named_parameters(prefix="net")][:2] == [
        "net.scale", "net.embed.weight"]
    assert all(isinstance(p, nn.Parameter) for p in net.parameters())


def test_a_shared_parameter_or_module_counts_once() -> None:
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight  # tied weights
    model = nn.Sequential(a, b, a)  # and a module used twice
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.bias"]
    assert len(list(model.parameters())) == 3
    assert [name for name, _ in model.named_modules()] == ["", "0", "1"]
    assert len(list(model.named_parameters(remove_duplicate=False))) == 6
    # state_dict keeps every name (as PyTorch's), so that loading finds each key
    assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias",
                                        "2.weight", "2.bias"]
    model.load_state_dict(model.state_dict())


def test_children_and_modules() -> None:
    net = Net()
    assert [name for name, _ in net.named_children()] == ["embed", "layers"]
    assert list(net.children()) == [net.embed, net.layers]
    assert [name for name, _ in net.named_modules()] == [
        "", "embed", "layers", "layers.0", "layers.1", "layers.2"]
    assert [type(m).__name__ for m in net.modules()] == [
        "Net", "Linear", "Sequential", "Linear", "Tanh", "Linear"]


def test_assignment_registers_and_rebinding_keeps_the_place() -> None:
    net = Net()
    net.plain = pargrad.ones(2, requires_grad=True)  # a Tensor that is no Parameter
    assert "plain" not in dict(net.named_parameters())
    net.embed = nn.Linear(3, 4)  # rebinding keeps its place among the children
    assert [name for name, _ in net.named_children()] == ["embed", "layers"]
    net.layers = None  # a slot without a module
    assert net.layers is None and [n for n, _ in net.named_children()] == ["embed"]
    del net.scale
    assert "scale" not in dict(net.named_parameters())
    with pytest.raises(AttributeError, match="no attribute 'scale'"):
        net.scale  # noqa: B018


def test_registration_errors() -> None:
    net = Net()
    with pytest.raises(TypeError, match=r"'scale', which is a Parameter of Net"):
        net.scale = pargrad.ones(2)  # a registered parameter takes Parameters only
    with pytest.raises(TypeError, match=r"must be a pargrad\.nn\.Parameter"):
        net.register_parameter("w", pargrad.ones(2))  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no dot"):
        net.register_parameter("a.b", nn.Parameter(pargrad.ones(1)))
    with pytest.raises(KeyError, match="already has an attribute 'embed'"):
        net.register_parameter("embed", nn.Parameter(pargrad.ones(1)))
    with pytest.raises(TypeError, match="must be a Module"):
        net.add_module("m", pargrad.ones(1))  # type: ignore[arg-type]

    class Forgot(nn.Module):
        def __init__(self) -> None:
            self.w = nn.Parameter(pargrad.ones(1))

    with pytest.raises(AttributeError, match=r"call super\(\).__init__\(\)"):
        Forgot()
    with pytest.raises(NotImplementedError, match="ModuleList has no forward"):
        nn.ModuleList([nn.Tanh()])(pargrad.ones(1))


def test_buffers_are_state_but_not_parameters() -> None:
    net = Net()
    net.register_buffer("count", pargrad.zeros(()))
    net.register_buffer("scratch", np.ones(3), persistent=False)
    assert "count" not in dict(net.named_parameters())
    assert [name for name, _ in net.named_buffers()] == ["count", "scratch"]
    assert isinstance(net.scratch, pargrad.Tensor)
    assert "count" in net.state_dict() and "scratch" not in net.state_dict()
    count = net.count
    state = net.state_dict()
    state["count"] = np.array(7.0)
    net.load_state_dict(state)
    assert net.count is count and count.item() == 7.0  # loaded in place
    net.count = pargrad.ones(())  # assignment replaces a buffer
    assert net.state_dict()["count"] == 1.0
    with pytest.raises(TypeError, match="buffer 'count' must be a Tensor"):
        net.count = "seven"


def test_parameter_shares_a_tensor_and_copies_an_array() -> None:
    t = pargrad.zeros(3)
    p = nn.Parameter(t)
    assert p.data is t.data and p.requires_grad and p.is_leaf and not t.requires_grad
    array = np.zeros(3)
    assert nn.Parameter(array).data is not array
    assert not nn.Parameter(array, requires_grad=False).requires_grad
    assert type(p * 2) is pargrad.Tensor
    assert repr(nn.Parameter(pargrad.ones(2))) == (
        "Parameter containing:\ntensor([1., 1.], dtype=float64, requires_grad=True)")
    with pytest.raises(TypeError, match="floating-point"):
        nn.Parameter([1, 2])


def test_deepcopy_and_pickle_keep_parameters_and_their_sharing() -> None:
    a = nn.Linear(2, 2)
    model = nn.Sequential(a, a)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone[0] is clone[1] and clone[0] is not a
        assert all(isinstance(p, nn.Parameter) for p in clone.parameters())
        np.testing.assert_array_equal(clone[0].weight.data, a.weight.data)
        assert clone[0].weight.data is not a.weight.data


# ----- modes and gradients -----
def test_train_and_eval_reach_every_submodule() -> None:
    net = Net()
    assert all(m.training for m in net.modules())
    assert net.eval() is net
    assert not any(m.training for m in net.modules())
    net.layers.train()
    assert [m.training for m in net.modules()] == [False, False, True, True, True, True]
    net.train()
    assert all(m.training for m in net.modules())
    with pytest.raises(TypeError, match="mode must be a bool"):
        net.train("eval")  # type: ignore[arg-type]


def test_zero_grad() -> None:
    pargrad.random.seed(0)  # (a draw whose ReLU is 0 everywhere leaves a gradient of 0)
    net = Net()
    net(pargrad.ones((2, 3))).sum().backward()
    grads = [p.grad for p in net.parameters()]
    assert all(g is not None and np.any(g.data) for g in grads)
    net.zero_grad(set_to_none=False)  # zeros, in the same tensors
    assert [p.grad for p in net.parameters()] == grads
    assert all(not np.any(g.data) for g in grads if g is not None)
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    # A gradient with a graph (create_graph=True) stays the same Tensor too, as with
    # Optimizer.zero_grad and PyTorch: cut off from its graph in place, then zeroed.
    (net(pargrad.ones((2, 3))) ** 2).sum().backward(create_graph=True)
    grads = [p.grad for p in net.parameters()]
    assert all(g is not None and g.grad_fn is not None for g in grads)
    net.zero_grad(set_to_none=False)
    assert all(p.grad is g for p, g in zip(net.parameters(), grads))
    assert all(g.grad_fn is None and not g.requires_grad and not np.any(g.data)
               for g in grads if g is not None)


def test_requires_grad_freezes_and_apply_visits_children_first() -> None:
    net = Net()
    net.embed.requires_grad_(False)
    net(pargrad.ones((1, 3))).sum().backward()
    assert net.embed.weight.grad is None and net.layers[0].weight.grad is not None
    seen: list[str] = []
    assert net.apply(lambda m: seen.append(type(m).__name__)) is net
    assert seen == ["Linear", "Linear", "Tanh", "Linear", "Sequential", "Net"]


# ----- state_dict -----
def test_state_dict_round_trip_is_bitwise_and_in_place() -> None:
    pargrad.random.seed(1)
    source = Net()
    pargrad.random.seed(2)
    target = Net()
    params = list(target.parameters())
    versions = [p._version for p in params]
    state = source.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    assert target.load_state_dict(state) == ([], [])
    assert list(target.parameters()) == params  # the same objects: an optimizer keeps them
    assert [p._version for p in params] == [v + 1 for v in versions]
    for name, value in target.state_dict().items():
        assert value.tobytes() == state[name].tobytes() and value.dtype == state[name].dtype
    x = pargrad.randn(5, 3)
    assert target(x).data.tobytes() == source(x).data.tobytes()


def test_state_dict_holds_copies() -> None:
    layer = nn.Linear(2, 2)
    state = layer.state_dict()
    with pargrad.no_grad():
        layer.weight += 1.0
    np.testing.assert_array_equal(state["weight"] + 1.0, layer.weight.data)


def test_strict_loading_reports_missing_unexpected_and_shapes_and_writes_nothing() -> None:
    net = Net()
    before = net.state_dict()
    state = Net().state_dict()
    del state["embed.bias"]
    state["extra"] = np.zeros(1)
    with pytest.raises(RuntimeError, match=r"missing keys: embed\.bias") as error:
        net.load_state_dict(state)
    assert "unexpected keys: extra" in str(error.value)
    assert all(np.array_equal(v, before[k]) for k, v in net.state_dict().items())

    keys = net.load_state_dict(state, strict=False)  # the rest loads
    assert keys.missing_keys == ["embed.bias"] and keys.unexpected_keys == ["extra"]
    np.testing.assert_array_equal(net.embed.weight.data, state["embed.weight"])
    np.testing.assert_array_equal(net.embed.bias.data, before["embed.bias"])

    bad = net.state_dict()
    bad["layers.0.weight"] = np.zeros((4, 5))
    with pytest.raises(RuntimeError, match=r"layers.0.weight: the state has shape \(4, 5\), "
                                           r"the module \(4, 4\)"):
        net.load_state_dict(bad, strict=False)  # shapes are checked even when not strict


def test_loading_casts_to_the_parameters_dtype_and_takes_tensors() -> None:
    layer = nn.Linear(2, 2, dtype=np.float32)
    state = {"weight": pargrad.ones((2, 2)), "bias": np.arange(2)}
    layer.load_state_dict(state)
    assert layer.weight.dtype == np.float32 and layer.bias.data.tolist() == [0.0, 1.0]


# ----- printing -----
def test_repr_nests_as_pytorch_prints() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                          nn.Sequential(nn.LayerNorm(8), nn.Dropout(0.1)),
                          nn.Linear(8, 2, bias=False))
    assert repr(model) == (
        "Sequential(\n"
        "  (0): Linear(in_features=4, out_features=8, bias=True)\n"
        "  (1): ReLU()\n"
        "  (2): Sequential(\n"
        "    (0): LayerNorm((8,), eps=1e-05, elementwise_affine=True)\n"
        "    (1): Dropout(p=0.1)\n"
        "  )\n"
        "  (3): Linear(in_features=8, out_features=2, bias=False)\n"
        ")")
    assert repr(nn.Embedding(10, 3)) == "Embedding(10, 3)"
    assert repr(nn.ReLU(inplace=True)) == "ReLU(inplace=True)"
    assert repr(nn.CrossEntropyLoss()) == "CrossEntropyLoss()"
    assert repr(nn.Module()) == "Module()"


# ----- containers -----
def test_sequential_indexes_like_a_list() -> None:
    layers = [nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)]
    model = nn.Sequential(*layers)
    assert len(model) == 3 and list(model) == layers
    assert model[0] is layers[0] and model[-1] is layers[2]
    tail = model[1:]
    assert isinstance(tail, nn.Sequential) and list(tail) == layers[1:]
    # the names are kept, as in PyTorch: a slice's state dict loads into the model's
    assert list(tail.state_dict()) == ["2.weight", "2.bias"]
    assert list(model[::2].state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(model[:0]) == []
    tail.append(nn.ReLU())  # the next number free, not one taken already
    assert list(tail._modules) == ["1", "2", "3"] and len(model) == 3
    with pytest.raises(IndexError, match="index 3 is out of range for 3"):
        model[3]
    extra = nn.Sigmoid()
    assert model.append(extra) is model and model[3] is extra
    model[1] = nn.ReLU()
    assert isinstance(model[1], nn.ReLU)
    x = pargrad.randn(4, 2)
    expected = pargrad.sigmoid(layers[2](pargrad.relu(layers[0](x))))
    np.testing.assert_array_equal(model(x).data, expected.data)
    named = nn.Sequential(OrderedDict(hidden=nn.Linear(2, 2), out=nn.Linear(2, 1)))
    assert [name for name, _ in named.named_parameters()][::2] == ["hidden.weight", "out.weight"]


def test_a_slice_of_a_subclass_is_a_plain_container() -> None:
    class Block(nn.Sequential):
        def __init__(self, width: int) -> None:  # a constructor of its own
            super().__init__(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))

    block = Block(3)
    head = block[1:]
    assert type(head) is nn.Sequential and list(head.state_dict()) == ["2.weight", "2.bias"]

    class Layers(nn.ModuleList):
        def __init__(self, count: int) -> None:
            super().__init__(nn.Linear(2, 2) for _ in range(count))

    layers = Layers(3)
    assert type(layers[1:]) is nn.ModuleList
    assert list(layers[1:].state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert layers[1:][0] is layers[1]  # numbered from 0 again, as PyTorch's


def test_module_list_registers_its_modules() -> None:
    blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
    blocks.append(nn.Linear(2, 1)).extend([nn.Tanh()])
    assert len(blocks) == 4 and len(list(blocks.parameters())) == 6
    assert isinstance(blocks[1:3], nn.ModuleList) and len(blocks[1:3]) == 2
    assert list(blocks.state_dict())[-2:] == ["2.weight", "2.bias"]


# ----- Linear -----
def test_linear_against_numpy() -> None:
    layer = nn.Linear(5, 3)
    x = np.random.default_rng(0).normal(size=(2, 4, 5))
    expected = x @ layer.weight.data.T + layer.bias.data
    np.testing.assert_allclose(layer(x).data, expected, rtol=1e-14)
    no_bias = nn.Linear(5, 3, bias=False)
    assert no_bias.bias is None and [n for n, _ in no_bias.named_parameters()] == ["weight"]
    np.testing.assert_allclose(no_bias(x).data, x @ no_bias.weight.data.T, rtol=1e-14)


def test_linear_initial_distribution_is_pytorchs_uniform() -> None:
    pargrad.random.seed(0)
    layer = nn.Linear(400, 500)
    bound = 1 / np.sqrt(400)
    for values in (layer.weight.data, layer.bias.data):
        assert np.abs(values).max() <= bound
    w = layer.weight.data.ravel()  # 200_000 draws of U(-b, b): mean 0, variance b²/3
    assert np.abs(w).max() > 0.999 * bound  # the bound is reached, not a smaller one
    assert abs(w.mean()) < 5 * bound / np.sqrt(3 * w.size)
    assert w.var() == pytest.approx(bound ** 2 / 3, rel=0.02)
    assert layer.weight.dtype == np.float64 and nn.Linear(2, 2, dtype=np.float32).bias.dtype \
        == np.float32


def test_the_seed_reproduces_a_model() -> None:
    def weights(seed: int) -> list[np.ndarray]:
        pargrad.random.seed(seed)
        model = nn.Sequential(nn.Linear(3, 4), nn.Embedding(5, 2))
        return [p.data for p in model.parameters()]

    assert all(np.array_equal(a, b) for a, b in zip(weights(3), weights(3)))
    assert not np.array_equal(weights(3)[0], weights(4)[0])


# ----- Dropout -----
def test_dropout_in_training_zeroes_and_scales() -> None:
    pargrad.random.seed(0)
    drop = nn.Dropout(0.25)
    x = pargrad.tensor(np.random.default_rng(0).uniform(1, 2, 100_000), requires_grad=True)
    y = drop(x)
    kept = y.data != 0
    np.testing.assert_allclose(y.data[kept], x.data[kept] / 0.75, rtol=1e-15)
    assert kept.mean() == pytest.approx(0.75, abs=0.01)
    y.sum().backward()  # the gradient goes through the kept elements only, scaled alike
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.data, kept / 0.75, rtol=1e-15)
    pargrad.random.seed(0)
    np.testing.assert_array_equal(drop(x).data, y.data)  # the seed gives the same mask


def test_dropout_in_eval_is_the_identity() -> None:
    x = pargrad.ones(10, requires_grad=True)
    drop = nn.Dropout(0.5).eval()
    assert drop(x) is x
    assert F.dropout(x, 0.0) is x
    assert not np.any(F.dropout(x, 1.0).data)
    with pytest.raises(ValueError, match="probability"):
        nn.Dropout(1.5)


def test_dropout_takes_its_own_generator() -> None:
    a = F.dropout(pargrad.ones(50), 0.5, generator=pargrad.Generator(7))
    b = F.dropout(pargrad.ones(50), 0.5, generator=pargrad.Generator(7))
    np.testing.assert_array_equal(a.data, b.data)


# ----- LayerNorm -----
def layer_norm_numpy(x: np.ndarray, axes: tuple[int, ...], w: np.ndarray, b: np.ndarray,
                     eps: float) -> np.ndarray:
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


@pytest.mark.parametrize("shape", [4, (3, 4)])
def test_layer_norm_against_numpy(shape: int | tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    norm = nn.LayerNorm(shape, eps=1e-3)
    assert norm.weight is not None and norm.bias is not None
    assert np.all(norm.weight.data == 1) and np.all(norm.bias.data == 0)
    with pargrad.no_grad():
        norm.weight[...] = rng.normal(size=norm.weight.shape)
        norm.bias[...] = rng.normal(size=norm.bias.shape)
    x = rng.normal(2.0, 3.0, size=(2, 3, 4))
    axes = (-1,) if shape == 4 else (-2, -1)
    expected = layer_norm_numpy(x, axes, norm.weight.data, norm.bias.data, 1e-3)
    np.testing.assert_allclose(norm(x).data, expected, rtol=1e-12, atol=1e-12)


def test_layer_norm_gradients_match_finite_differences() -> None:
    rng = np.random.default_rng(2)
    x = pargrad.tensor(rng.normal(size=(3, 5)), requires_grad=True)
    w = pargrad.tensor(rng.normal(size=5), requires_grad=True)
    b = pargrad.tensor(rng.normal(size=5), requires_grad=True)
    assert pargrad.gradcheck(lambda x, w, b: F.layer_norm(x, 5, w, b) ** 2, [x, w, b])


def test_layer_norm_without_affine_and_shape_errors() -> None:
    norm = nn.LayerNorm(3, elementwise_affine=False)
    assert norm.weight is None and list(norm.parameters()) == []
    assert [n for n, _ in nn.LayerNorm(3, bias=False).named_parameters()] == ["weight"]
    with pytest.raises(ValueError, match=r"last axes must be normalized_shape \(3,\)"):
        norm(pargrad.ones((3, 4)))


# ----- Embedding -----
def test_embedding_gradient_accumulates_for_repeated_indices() -> None:
    table = nn.Embedding(5, 3)
    indices = np.array([[1, 3], [1, 1]])
    out = table(indices)
    np.testing.assert_array_equal(out.data, table.weight.data[indices])
    upstream = np.arange(12.0).reshape(2, 2, 3)
    out.backward(pargrad.tensor(upstream))
    assert table.weight.grad is not None
    expected = np.zeros((5, 3))
    expected[1] = upstream[0, 0] + upstream[1, 0] + upstream[1, 1]
    expected[3] = upstream[0, 1]
    np.testing.assert_array_equal(table.weight.grad.data, expected)


def test_embedding_starts_standard_normal_and_checks_indices() -> None:
    pargrad.random.seed(0)
    w = nn.Embedding(1000, 100).weight.data
    assert abs(w.mean()) < 0.02 and w.std() == pytest.approx(1.0, rel=0.02)
    table = nn.Embedding(4, 2)
    with pytest.raises(TypeError, match="indices must be integers"):
        table([0.0, 1.0])
    with pytest.raises(IndexError, match=r"-1..2 are out of range for 4"):
        table([2, -1])
    assert table(pargrad.tensor([3, 0])).shape == (2, 2)


# ----- losses, activations -----
def test_losses_as_modules_equal_the_functions() -> None:
    rng = np.random.default_rng(3)
    logits = pargrad.tensor(rng.normal(size=(6, 4)))
    labels = rng.integers(0, 4, 6)
    for reduction in ("mean", "sum", "none"):
        np.testing.assert_array_equal(
            nn.CrossEntropyLoss(reduction)(logits, labels).data,
            pargrad.cross_entropy(logits, labels, reduction=reduction).data)
        np.testing.assert_array_equal(
            nn.MSELoss(reduction=reduction)(logits, logits.data ** 2).data,
            pargrad.mse_loss(logits, logits.data ** 2, reduction=reduction).data)
    per_class_first = logits.data.T.copy()  # classes along axis 0
    np.testing.assert_array_equal(nn.CrossEntropyLoss(axis=0)(per_class_first, labels).data,
                                  pargrad.cross_entropy(logits, labels).data)
    with pytest.raises(ValueError, match="reduction must be one of"):
        nn.MSELoss("average")


def test_activation_modules_equal_the_functions() -> None:
    x = pargrad.tensor([-2.0, 0.5, 3.0])
    for module, fn in ((nn.ReLU(), pargrad.relu), (nn.Tanh(), pargrad.tanh),
                       (nn.Sigmoid(), pargrad.sigmoid)):
        np.testing.assert_array_equal(module(x).data, fn(x).data)
    y = x.copy()
    assert nn.ReLU(inplace=True)(y) is y and y.data.tolist() == [0.0, 0.5, 3.0]


# ----- gradients through a model -----
def test_gradcheck_through_a_small_sequential() -> None:
    pargrad.random.seed(5)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 2),
                          nn.Sigmoid())
    x = pargrad.randn(5, 3, requires_grad=True)

    def fn(x: pargrad.Tensor, *params: pargrad.Tensor) -> pargrad.Tensor:
        with parameters_replaced(model, list(params)):
            return model(x)

    assert pargrad.gradcheck(fn, [x, *model.parameters()])
    # (fn computes with the leaves it is given, so gradcheck checked their gradients)
    leaves = [p.detach().requires_grad_() for p in model.parameters()]
    grads = pargrad.grad(fn(x, *leaves).sum(), leaves)
    assert all(np.any(g.data) for g in grads)


def test_backward_fills_each_parameters_grad_as_the_functional_form() -> None:
    pargrad.random.seed(6)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x, labels = pargrad.randn(8, 3), np.arange(8) % 2
    pargrad.cross_entropy(model(x), labels).backward()
    w1, b1, w2, b2 = (p.detach().requires_grad_() for p in model.parameters())
    loss = pargrad.cross_entropy(pargrad.relu(x @ w1.T + b1) @ w2.T + b2, labels)
    expected = pargrad.grad(loss, [w1, b1, w2, b2])
    for p, g in zip(model.parameters(), expected):
        assert p.grad is not None
        np.testing.assert_allclose(p.grad.data, g.data, rtol=1e-12, atol=1e-15)


# ----- PyTorch, optional -----
def test_the_same_model_in_torch_gives_the_same_values_and_gradients() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU(),
                                    torch.nn.LayerNorm(6), torch.nn.Linear(6, 3)).double()
    with torch.no_grad():  # LayerNorm's affine parameters away from ones and zeros
        reference[2].weight.uniform_(0.5, 1.5)
        reference[2].bias.uniform_(-0.5, 0.5)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.LayerNorm(6), nn.Linear(6, 3))
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    assert model.load_state_dict(state) == ([], [])  # the same names as torch.nn's
    x = np.random.default_rng(4).normal(size=(7, 5))
    labels = np.arange(7) % 3
    torch_loss = torch.nn.CrossEntropyLoss()(reference(torch.from_numpy(x)),
                                             torch.from_numpy(labels))
    torch_loss.backward()
    loss = nn.CrossEntropyLoss()(model(x), labels)
    loss.backward()
    assert loss.item() == pytest.approx(torch_loss.item(), rel=1e-12)
    torch_grads = {name: p.grad.numpy() for name, p in reference.named_parameters()}
    assert list(torch_grads) == [name for name, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        assert p.grad is not None
        np.testing.assert_allclose(p.grad.data, torch_grads[name], rtol=1e-10, atol=1e-13,
                                   err_msg=name)

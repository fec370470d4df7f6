"""tritonformer.optim.AdamW against torch.optim.AdamW over several steps (the kernel's one step
against a float64 reference is the registry's test), its state_dict both ways, torch.compile,
and bad input."""

import pytest
import torch

import tritonformer
from tritonformer import runtime
from tritonformer.ops.adamw import adamw_step
from tritonformer.optim import AdamW
from tritonformer.testing import check_close

from conftest import ON_GPU, gpu_only
from helpers import fresh_launchers

DEVICE = runtime.DEVICE


def _model_params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (4097,), (1,), (0, 2), (64, 33)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE, dtype)) for s in shapes]


def _train(opt_class, params, steps, skip=(), scheduler=False, grad_dtype=None, **options):
    """The optimizer after `steps` steps of random gradients (the same for every optimizer, drawn
    in grad_dtype, the params' by default); the param at index i gets no gradient at the steps
    listed in skip[i]."""
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-2, "weight_decay": 0.0}]
    opt = opt_class(groups, lr=1e-2, weight_decay=0.1, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1)) if scheduler else None
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g).to(DEVICE, grad_dtype or p.dtype).to(p.dtype)
            p.grad = None if step in dict(skip).get(i, ()) else grad
        opt.step()
        if sched is not None:
            sched.step()
    return opt


@pytest.mark.parametrize("dtype", runtime.FLOAT_DTYPES)
@pytest.mark.parametrize("options", [{}, {"amsgrad": True, "maximize": True, "betas": (0.8, 0.99)}])
def test_matches_torch_adamw_over_steps(dtype, options):
    # torch's AdamW in float32 from the same values: in fp16 its own step overflows (eps 1e-8 is 0 there).
    ours, theirs = _model_params(dtype), [torch.nn.Parameter(p.float()) for p in _model_params(dtype)]
    skip = [(1, (2, 3))]  # a param without a gradient skips the step and keeps its count
    opt = _train(AdamW, ours, 6, skip, scheduler=True, **options)
    ref = _train(torch.optim.AdamW, theirs, 6, skip, scheduler=True, grad_dtype=dtype, foreach=False, **options)
    # Norm-wise over all tensors: 16-bit params and moments round each step, where float32 does not.
    def flat(tensors):
        return torch.cat([t.detach().float().flatten() for t in tensors])

    assert check_close(flat(ours), flat(theirs), dtype, "norm") is None
    live = [(p, q) for p, q in zip(ours, theirs) if p.numel()]
    for name in ("exp_avg", "exp_avg_sq"):
        assert check_close(flat(opt.state[p][name] for p, _ in live), flat(ref.state[q][name] for _, q in live),
                           dtype, "norm") is None, name
    assert [float(opt.state[p]["step"]) for p, _ in live] == [float(ref.state[q]["step"]) for _, q in live]
    assert float(opt.state[ours[1]]["step"]) == 4


def test_a_learning_rate_tensor_is_read_where_it_lives():
    ours, theirs = _model_params(torch.float32), _model_params(torch.float32)
    lr = torch.tensor(1e-2, device=DEVICE)
    opt = AdamW(ours, lr=lr)
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    for _ in range(2):
        for p, q in zip(ours, theirs):
            p.grad = torch.ones_like(p)
            q.grad = torch.ones_like(q)
        opt.step()
        ref.step()
        lr.fill_(5e-3)  # in place, as a scheduler updates a tensor learning rate
        ref.param_groups[0]["lr"] = 5e-3
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_state_dict_loads_both_ways_with_torch():
    ours, theirs = _model_params(torch.float32), _model_params(torch.float32)
    opt = _train(AdamW, ours, 3)
    ref = _train(torch.optim.AdamW, theirs, 3, foreach=False)
    # torch's state_dict (step counts on the host) into ours, and ours into torch's.
    into_ours, into_torch = _model_params(torch.float32, seed=5), _model_params(torch.float32, seed=5)
    for src, dst in ((theirs, into_ours), (ours, into_torch)):
        with torch.no_grad():
            for s, d in zip(src, dst):
                d.copy_(s)
    loaded_ours = _train(AdamW, into_ours, 0)
    loaded_ours.load_state_dict(ref.state_dict())
    loaded_torch = _train(torch.optim.AdamW, into_torch, 0, foreach=False)
    loaded_torch.load_state_dict(opt.state_dict())
    assert all(s["step"].device == p.device for p, s in loaded_ours.state.items())
    for pair in ((loaded_ours, into_ours), (loaded_torch, into_torch)):
        for p in pair[1]:
            p.grad = torch.ones_like(p)
        pair[0].step()
    for p, q in zip(into_ours, into_torch):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_steps_in_a_compiled_function():
    params = _model_params(torch.float32)
    states = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    steps = [torch.zeros((), device=DEVICE) for _ in params]
    grads = [torch.ones_like(p) for p in params]
    reference = [p.detach().clone() for p in params]

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step():
        adamw_step(params, grads, *states, steps, lr=1e-2)

    with torch.no_grad():
        step()
        adamw_step(reference, grads, *[[torch.zeros_like(p) for p in params] for _ in range(2)],
                   [torch.zeros((), device=DEVICE) for _ in params], lr=1e-2)
    for p, q in zip(params, reference):
        torch.testing.assert_close(p, q)
    assert all(float(s) == 1 for s in steps)


def test_bad_input_is_named():
    p = torch.nn.Parameter(torch.randn(4, device=DEVICE))
    with pytest.raises(ValueError, match="differentiable"):
        AdamW([p], differentiable=True)
    ok = dict(lr=1e-3)
    lists = lambda n=1: [[torch.zeros(4, device=DEVICE) for _ in range(n)] for _ in range(4)]  # noqa: E731
    steps = [torch.zeros((), device=DEVICE)]
    with pytest.raises(ValueError, match="grads has 2 tensors, params 1"):
        params, _, m, v = lists()
        adamw_step(params, lists(2)[0], m, v, steps, **ok)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] is torch.float32 of shape \(3,\)"):
        params, grads, _, v = lists()
        adamw_step(params, grads, [torch.zeros(3, device=DEVICE)], v, steps, **ok)
    with pytest.raises(TypeError, match=r"steps\[0\] has dtype torch.int64"):
        adamw_step(*lists(), [torch.zeros((), dtype=torch.int64, device=DEVICE)], **ok)
    with pytest.raises(TypeError, match=r"params\[0\] has dtype torch.float64"):
        adamw_step(*[[t.double() for t in column] for column in lists()], steps, **ok)
    with pytest.raises(ValueError, match="lr must be finite"):
        adamw_step(*lists(), steps, lr=float("nan"))
    with pytest.raises(ValueError, match="steps holds one tensor twice"):
        adamw_step(*lists(2), steps * 2, **ok)
    p.grad = torch.zeros(4, device=DEVICE).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        AdamW([p]).step()


def test_exported():
    assert tritonformer.optim.AdamW is AdamW and tritonformer.adamw_step is adamw_step
    assert isinstance(AdamW([torch.nn.Parameter(torch.zeros(1, device=DEVICE))]), torch.optim.AdamW)


def test_a_gradient_at_the_same_address_with_other_strides_is_not_taken_for_the_planned_one():
    ours, theirs = torch.nn.Parameter(torch.randn(4, 8, device=DEVICE)), torch.nn.Parameter(torch.randn(4, 8))
    with torch.no_grad():
        theirs.copy_(ours.cpu())
    opt, ref = AdamW([ours], lr=1e-2), torch.optim.AdamW([theirs], lr=1e-2, foreach=False)
    buffer = torch.randn(32, device=DEVICE)
    for layout in (lambda b: b.view(4, 8), lambda b: b.view(8, 4).t()):  # one address, two layouts
        buffer.copy_(torch.randn(32))
        ours.grad, theirs.grad = layout(buffer), layout(buffer).cpu()
        opt.step()
        ref.step()
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), rtol=1e-5, atol=1e-6)


def test_float64_params_take_torchs_arithmetic():
    ours, theirs = _model_params(torch.float64), _model_params(torch.float64)
    _train(AdamW, ours, 3, amsgrad=True)
    _train(torch.optim.AdamW, theirs, 3, foreach=False, amsgrad=True)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_many_launches_a_step_keep_their_plans():
    from tritonformer.ops import adamw as adamw_op

    params = [torch.nn.Parameter(torch.randn(3 + i, device=DEVICE)) for i in range(12)]
    opt = AdamW([{"params": [p]} for p in params], lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    plans = dict(adamw_op._PLANS)
    opt.step()
    assert all(adamw_op._PLANS.get(key) is plan for key, plan in plans.items())


def test_a_warm_up_launches_nothing_and_keeps_no_plan():
    from tritonformer.ops import adamw as adamw_op

    params, grads = [torch.ones(5, device=DEVICE)], [torch.ones(5, device=DEVICE)]
    states, steps = [[torch.zeros(5, device=DEVICE)] for _ in range(2)], [torch.zeros((), device=DEVICE)]
    plans = dict(adamw_op._PLANS)
    runtime.compile_only(adamw_step, params, grads, *states, steps, lr=1e-2)
    assert dict(adamw_op._PLANS) == plans
    assert float(steps[0]) == 0 and torch.equal(params[0], torch.ones(5, device=DEVICE))


def test_a_warm_up_readies_the_kernels_of_a_real_step(monkeypatch):
    """The optimizer's warm-up (one 16-element tensor, as AdamW._compile_ahead makes it) compiles
    the specializations that a step of other sizes and counts launches."""
    fresh_launchers(monkeypatch)
    example = [[torch.zeros(16, device=DEVICE)] for _ in range(4)]
    runtime.compile_only(adamw_step, *example, [torch.zeros((), device=DEVICE)], lr=0.0)
    runtime.wait_for_background_work()
    ahead = runtime.launched_ahead()
    sizes = (5, 4100, 3)
    params, grads = [[torch.randn(n, device=DEVICE) for n in sizes] for _ in range(2)]
    states = [[torch.zeros(n, device=DEVICE) for n in sizes] for _ in range(2)]
    adamw_step(params, grads, *states, [torch.zeros((), device=DEVICE) for _ in sizes], lr=1e-3)
    launched = runtime.launch_keys()
    assert len(launched) == 2 and launched <= ahead, (launched, ahead)


def _assert_captured_trains_as_eagerly(build, steps: int) -> None:
    """build() -> (loss_of(x), optimizer, x, params): `steps` training steps through capture_step
    and eagerly, from fresh builds, give the same losses and parameters bit for bit."""
    def train(captured):
        loss_of, opt, x, params = build()

        def step(x):
            loss = loss_of(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        run = tritonformer.capture_step(step) if captured else step
        losses = torch.stack([run(x).detach() for _ in range(steps)])
        return losses, [p.detach().clone() for p in params]

    (losses, params), (ref_losses, ref_params) = train(True), train(False)
    assert torch.equal(losses, ref_losses) and all(torch.equal(p, q) for p, q in zip(params, ref_params))


@gpu_only
def test_two_launches_of_one_size_captured_train_as_eagerly():
    """Two parameter groups whose tables have one size: each capture needs its own pinned buffer."""
    def build():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 64, device="cuda") for _ in range(2)]
        opt = AdamW([{"params": layer.parameters()} for layer in layers], lr=1e-3)
        x = torch.randn(8, 64, device="cuda")
        return (lambda x: layers[1](layers[0](x)).square().mean()), opt, x, [
            p for layer in layers for p in layer.parameters()]

    _assert_captured_trains_as_eagerly(build, 6)


def _tied_model(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 50), torch.nn.Linear(2, 2)).to(device)
    model[3].weight = model[0].weight  # tied: its hook runs once, after both uses' gradients are summed
    model[4].requires_grad_(False)  # frozen: no hook
    return model


@pytest.mark.parametrize("options", [{}, {"amsgrad": True, "maximize": True}])
def test_step_in_backward_steps_as_the_usual_step(options):
    """Each parameter stepped inside backward (its gradient then freed) ends bit for bit where the
    usual step does, over two groups, a tied weight and a frozen layer; step() and zero_grad()
    after it find nothing to do."""
    models = [_tied_model(DEVICE) for _ in range(2)]
    opts = []
    for model, in_backward in zip(models, (False, True)):
        params = list(model.parameters())
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-2, "weight_decay": 0.0}]
        opts.append(AdamW(groups, lr=1e-2, weight_decay=0.1, step_in_backward=in_backward, **options))
    for _ in range(3):
        ids = torch.randint(0, 50, (4, 7), device=DEVICE)
        for model, opt in zip(models, opts):
            logits = model[:4](ids).flatten(0, 1)
            torch.nn.functional.cross_entropy(logits, ids.flatten()).backward()
            if opt is opts[1]:
                assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    assert [float(s["step"]) for s in opts[1].state.values()] == [3.0] * 4
    with pytest.raises(TypeError, match="step_in_backward"):
        AdamW(models[0].parameters(), step_in_backward=1)
    # One optimizer a parameter steps it inside backward, while it lives.
    with pytest.raises(ValueError, match="already stepped inside backward"):
        AdamW(models[1].parameters(), step_in_backward=True)


def test_step_in_backward_reads_loaded_groups_and_keeps_a_plan_a_parameter(monkeypatch):
    """A loaded state_dict's groups (new dicts) are the ones the hooks read: a learning rate of 0
    loaded leaves the parameters where they are. On a GPU, a model of more parameters than the
    launch cache's former 64 reuses each parameter's plan once the gradients' addresses repeat
    (the CPU allocator gives new ones each step)."""
    from tritonformer.ops import adamw

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)]).to(DEVICE)  # 80 parameters
    opt = AdamW(layers.parameters(), lr=1e-2, step_in_backward=True)
    built = []
    monkeypatch.setattr(adamw, "_plan", lambda *a, _plan=adamw._plan: built.append(1) or _plan(*a))
    x = torch.randn(3, 4, device=DEVICE)
    for step in range(4):
        before_step = len(built)
        layers(x).square().sum().backward()
        opt.step()
    assert len(built) >= 80 and (len(built) == before_step or not ON_GPU)
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = 0.0
    opt.load_state_dict(state)
    before = [p.detach().clone() for p in layers.parameters()]
    layers(x).square().sum().backward()
    assert all(torch.equal(p, q) for p, q in zip(layers.parameters(), before))


@gpu_only
def test_step_in_backward_captured_trains_as_eagerly():
    def build():
        model = _tied_model("cuda")
        model.append(torch.nn.Sequential(*[torch.nn.Linear(50, 50) for _ in range(40)]).cuda())  # 80 more params
        opt = AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
        ids = torch.randint(0, 50, (4, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

        def loss_of(ids):
            return torch.nn.functional.cross_entropy(model[5](model[:4](ids)).flatten(0, 1), ids.flatten())

        return loss_of, opt, ids, list(model.parameters())

    _assert_captured_trains_as_eagerly(build, 5)

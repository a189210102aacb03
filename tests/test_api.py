"""The public API contract: options, the entry point, explain, optimize, dumps, the CLI."""
import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fxopt
from fxopt.errors import FxoptError
from fxopt.options import Environment


def chain(x, b):
    return torch.tanh(F.gelu(x + b) * 2.0) - x


def inputs():
    return torch.randn(6, 10), torch.randn(10)


def test_unknown_option_lists_valid_ones():
    with pytest.raises(TypeError, match="valid options are .*precision.*fuse"):
        fxopt.backend(fusion=True)
    with pytest.raises(TypeError, match="unknown option"):
        fxopt.explain(chain, *inputs(), bogus=1)


def test_bad_precision_value_is_rejected():
    with pytest.raises(ValueError, match="precision"):
        fxopt.Options(precision="int4")


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(ep.name == "fxopt" and ep.value == "fxopt.entry_point:fxopt_backend" for ep in eps)


def test_backend_string_compiles_and_matches_eager():
    x, b = inputs()
    out = torch.compile(chain, backend="fxopt")(x, b)
    torch.testing.assert_close(out, chain(x, b), rtol=1e-5, atol=1e-6)


def test_explain_reports_passes_kernels_and_fallbacks():
    x, b = inputs()

    def f(x, b):
        y = chain(x, b)
        return (y @ x.t()).sum(), y.argmax(-1)

    rep = fxopt.explain(f, x, b)
    names = [p.name for p in rep.passes]
    assert names[:11] == ["fuse_attention", "fuse_linear_cross_entropy", "fuse_cross_entropy", "upcast_logsumexp",
                          "cleanup", "cpu_scalars_to_device", "sums_through_views", "fold_matmul_casts",
                          "recompute_for_reductions", "fuse_reductions", "fuse"]
    assert all(p.seconds >= 0 and p.nodes_before >= p.nodes_after - 1 for p in rep.passes)
    kinds = sorted(k.kind for k in rep.kernels)
    assert kinds == ["pointwise", "reduction"]
    pointwise = next(k for k in rep.kernels if k.kind == "pointwise")
    assert "aten.gelu.default" in pointwise.ops and "aten.tanh.default" in pointwise.ops
    assert "@triton.jit" in pointwise.source
    reasons = dict(rep.fallbacks)
    assert any("matmul" in r for r in reasons.values())
    assert any("not a reduction fxopt generates" in r for r in reasons.values())  # argmax
    fused = rep.graph(after="fuse")
    assert any(n.op == "call_module" for n in fused.graph.nodes)
    captured = rep.graph(after="captured")
    assert not any(n.op == "call_module" for n in captured.graph.nodes)
    with pytest.raises(KeyError, match="no pass named"):
        rep.graph(after="nope")
    text = str(rep)
    assert "fuse" in text and "kernels (2)" in text and "left to ATen" in text


def test_explain_compiles_backward_graph_when_grad_is_needed():
    x, b = inputs()
    rep = fxopt.explain(chain, x.requires_grad_(), b)
    assert [g.name for g in rep.graphs] == ["forward", "backward"]
    assert any(k.graph == "backward" for k in rep.kernels)


def test_optimize_returns_a_compiled_callable_with_its_report():
    x, b = inputs()
    g = fxopt.optimize(chain, x, b)
    torch.testing.assert_close(g(x, b), chain(x, b), rtol=1e-5, atol=1e-6)
    assert len(g.report.kernels) == 1


def test_fxopt_dump_writes_every_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("FXOPT_DUMP", str(tmp_path))
    x, b = inputs()
    torch.compile(chain, backend="fxopt")(x, b)
    files = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert {"report.html", "report.txt", "wrapper.py"} <= files
    assert any(f.startswith("passes/") and f.endswith("_fuse.txt") for f in files)
    kernel_files = [f for f in files if f.startswith("kernels/")]
    assert len(kernel_files) == 1
    fuse_text = next((tmp_path / f).read_text() for f in files if f.endswith("_fuse.txt"))
    assert "# f32[6, 10] cpu" in fuse_text  # every value carries its type comment
    html = (tmp_path / "report.html").read_text()
    assert "<html>" in html
    for external in ('src="http', "src='http", 'href="http', "href='http", "<link", "@import", "url(http"):
        assert external not in html  # self-contained: nothing fetched from the network


def test_fxopt_dump_keeps_one_file_per_kernel_and_pass_across_graphs(tmp_path, monkeypatch):
    """Two compiled graphs (a static one, then the dynamic recompile): the first graph's kernel file is
    not overwritten by the second's (kernel names restart per graph), and the rewritten dump leaves no
    stale pass files behind (each graph's captured graph once, numbered apart from the passes)."""
    monkeypatch.setenv("FXOPT_DUMP", str(tmp_path))
    f = torch.compile(lambda x: (x * 2 + 1).sigmoid(), backend="fxopt")
    f(torch.randn(4, 8))
    f(torch.randn(3, 5))
    kernels = sorted(p.name for p in (tmp_path / "kernels").glob("*.py"))
    assert len(kernels) == 2 and len(set(kernels)) == 2, kernels
    assert any("4, 8" in (tmp_path / "kernels" / k).read_text() for k in kernels)  # the static graph's kernel
    captured = sorted(p.name for p in (tmp_path / "passes").glob("*_captured.txt"))
    assert len(captured) == 2, captured
    numbers = [p.name[:2] for p in (tmp_path / "passes").glob("*.txt")]
    assert len(numbers) == len(set(numbers)), sorted(numbers)


def test_a_dump_removes_only_files_an_earlier_dump_wrote(tmp_path, monkeypatch):
    """A dump into a project directory: the user's own kernels/*.py and numbered notes stay (a sweep found
    every *.py under kernels/ deleted); an earlier dump's files are replaced."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "passes").mkdir()
    mine = [tmp_path / "kernels" / "my_kernel.py", tmp_path / "kernels" / "__init__.py",
            tmp_path / "passes" / "01_x.txt"]
    for path in mine:
        path.write_text("user file\n")
    monkeypatch.setenv("FXOPT_DUMP", str(tmp_path))
    torch.compile(lambda x: x.sin() * 2, backend="fxopt")(torch.randn(4))
    from fxopt.dump import MANIFEST
    stale = tmp_path / "kernels" / "fused_gone_0.py"  # as if an earlier dump had written a kernel no longer made
    stale.write_text("old kernel\n")
    with open(tmp_path / MANIFEST, "a") as f:
        f.write("kernels/fused_gone_0.py\n")
    torch._dynamo.reset()
    torch.compile(lambda x: x.cos() + 1, backend="fxopt")(torch.randn(4))
    assert all(path.read_text() == "user file\n" for path in mine)
    assert not stale.exists() and (tmp_path / "wrapper.py").exists()
    listed = (tmp_path / MANIFEST).read_text().split()
    assert all((tmp_path / rel).is_file() for rel in listed) and "wrapper.py" in listed


def test_wrapper_of_a_dynamic_graph_runs_on_its_own(tmp_path):
    """Sizes passed as numbers get their example values (INPUT_SPECS held None for them: a TypeError)."""
    torch.compile(lambda x: (x.sin() * 2).softmax(-1), backend=fxopt.backend(dump_dir=str(tmp_path)),
                  dynamic=True)(torch.randn(6, 8))
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(tmp_path / "wrapper.py")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0 (6, 8)" in out.stdout


@pytest.mark.parametrize("case", ["dynamic_applied_plan", "expanded_input"])
def test_more_dumped_wrappers_run_on_their_own(tmp_path, case):
    """A symbolic graph with memory_plan="apply" looks its plan up per call in PLANS, which only the compile
    handed the module (standalone: NameError; the file now rebuilds it); an expanded (stride-0) input was
    made with empty_strided + copy_, which refuses to write overlapping elements."""
    if case == "dynamic_applied_plan":
        fn, args = (lambda x: ((x * 2).softmax(-1) - 1).relu().cumsum(-1)), (torch.randn(6, 40),)
        backend, dynamic, shape = fxopt.backend(memory_plan="apply", dump_dir=str(tmp_path)), True, "(6, 40)"
    else:
        fn, args = (lambda x, y: (x * 2 + y).sigmoid()), (torch.randn(1, 16).expand(8, 16), torch.randn(8, 16))
        backend, dynamic, shape = fxopt.backend(dump_dir=str(tmp_path)), False, "(8, 16)"
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend=backend, dynamic=dynamic)(*args), fn(*args))
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(tmp_path / "wrapper.py")], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"0 {shape}" in out.stdout


def test_wrapper_runs_on_its_own(tmp_path):
    x, b = inputs()
    rep = fxopt.explain(chain, x, b)
    path = tmp_path / "wrapper.py"
    path.write_text(rep.wrapper_source)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "0 (6, 10)" in out.stdout


def test_wrapper_refuses_inputs_with_other_strides():
    x, b = inputs()
    rep = fxopt.explain(chain, x, b)
    namespace = {}
    exec(compile(rep.wrapper_source, "<wrapper>", "exec"), namespace)  # noqa: S102 - our own generated code
    with pytest.raises(RuntimeError, match="compiled for shape"):
        namespace["call"]([x.t().contiguous().t(), b])


def test_cli_explain_and_dump(tmp_path):
    model_file = tmp_path / "model.py"
    model_file.write_text("import torch\n"
                          "def make():\n"
                          "    return (lambda x: torch.relu(x) * 2 + 1), (torch.randn(4, 5),)\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "fxopt", "explain", f"{model_file}:make", "--dump",
                          str(tmp_path / "dump")], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "kernels (1)" in out.stdout
    assert (tmp_path / "dump" / "report.html").exists()
    bad = subprocess.run([sys.executable, "-m", "fxopt", "explain", f"{model_file}:nope"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "no function 'nope'" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "fxopt", "explain", "missing.py:make"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert missing.returncode != 0 and "no such file" in missing.stderr


def test_cpu_without_interpreter_runs_subgraphs_eagerly_and_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    import fxopt.compile as comp
    monkeypatch.setattr(comp, "_warned_eager", False)
    x, b = inputs()
    with pytest.warns(UserWarning, match="TRITON_INTERPRET is not set"):
        out = torch.compile(chain, backend="fxopt")(x, b)
    torch.testing.assert_close(out, chain(x, b), rtol=1e-5, atol=1e-6)


def test_mixed_devices_error_names_the_node():
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxopt.compile import check_devices

    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    add = g.call_function(torch.ops.aten.add.Tensor, (a, b))
    g.output(add)
    gm = fx.GraphModule({}, g)
    with FakeTensorMode():
        a.meta["val"] = torch.empty(4, device="cpu")
        b.meta["val"] = torch.empty(4, device="meta")
    with pytest.raises(FxoptError, match="node 'add_tensor' .* mixes devices.*Fix: move"):
        check_devices(gm)


def test_fxopt_log_info_prints_one_line_per_compiled_graph(monkeypatch, capsys):
    monkeypatch.setenv("FXOPT_LOG", "info")
    x, b = inputs()
    torch.compile(chain, backend="fxopt")(x, b)
    err = capsys.readouterr().err
    assert "fxopt: compiled inference graph in" in err and "1 kernels" in err and "MiB planned" in err


def test_dumped_kernels_run_on_their_own(tmp_path):
    def f(x, b):
        return torch.softmax(chain(x, b), -1), chain(x, b).t() + 1

    x, b = inputs()
    fxopt.explain(f, x, b).save(str(tmp_path))
    files = sorted((tmp_path / "kernels").glob("*.py"))
    assert len(files) >= 2
    env = dict(os.environ, TRITON_INTERPRET="1")
    for path in files:
        out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, (path.name, out.stderr[-2000:])
        assert "output 0:" in out.stdout and "nan" not in out.stdout


def test_report_html_draws_the_graph_with_kernels_linked(tmp_path):
    x, b = inputs()
    rep = fxopt.explain(chain, x, b)
    rep.save(str(tmp_path))
    html = (tmp_path / "report.html").read_text()
    kernel = rep.kernels[0].name
    assert f'<a href="#{kernel}">' in html and f"id='{kernel}'" in html
    assert html.count("<rect") >= len(list(rep.graph(after="cleanup_after_fuse").graph.nodes))


def test_cudagraphs_option_on_cpu_says_why_it_runs_without_graphs(monkeypatch):
    from fxopt import cudagraphs
    monkeypatch.setattr(cudagraphs, "_warned", set())  # warnings are once per process
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="runs without CUDA graphs"):
        rep = fxopt.explain(lambda x: x * 2, x, cudagraphs=True)
    assert any(n == "cudagraphs" and "CUDA graphs need CUDA tensors" in r for n, r in rep.fallbacks)  # test_cudagraphs.py has the rest


def test_torch_compile_options_dict_reaches_fxopt_and_inductor_modes_are_refused():
    f = lambda x: (x * 2 + 1).sigmoid()  # noqa: E731
    x = torch.randn(3, 5)
    out = torch.compile(f, backend="fxopt", options={"memory_plan": False, "fuse": False})(x)
    torch.testing.assert_close(out, f(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Inductor setting"):
        torch.compile(f, backend="fxopt", mode="max-autotune")(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown option"):
        torch.compile(f, backend="fxopt", options={"bogus": 1})(x)


@pytest.mark.parametrize("bad", [{"fuse": "no"}, {"attention": None}, {"verify": "yes"}, {"verify_rtol": -1},
                                 {"verify_rtol": "a"}, {"dump_dir": 5}, {"skip_passes": None},
                                 {"skip_passes": (3,)}, {"all_reduce_bucket_mb": True},
                                 {"all_reduce_bucket_mb": float("nan")}])
def test_option_values_are_checked_when_given(bad):
    """A string where a bool is expected would be truthy; a negative tolerance would blame a correct pass."""
    (name,) = bad
    with pytest.raises((TypeError, ValueError), match=name):
        fxopt.backend(**bad)


def test_skip_passes_given_as_a_list_is_taken():
    assert fxopt.Options(skip_passes=["combine_casts"]).skip_passes == ("combine_casts",)


def test_attention_site_has_the_contracts_fallback_field():
    """DESIGN.md's AttentionSite(..., fallback): None when fused, else the reason."""
    rep = fxopt.explain(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), -2) @ v,
                        *(torch.randn(1, 2, 8, 16) for _ in range(3)))
    site = rep.attention[0]
    assert not site.fused and site.fallback == site.reason and "dim" in site.fallback


def test_torch_level_pass_text_comments_every_value_with_its_type():
    """Dynamo's graphs keep fake values under example_value: the attention pass's text said `None`."""
    q = torch.randn(1, 2, 8, 16)
    rep = fxopt.explain(lambda q: torch.softmax(q @ q.mT * 0.25, -1) @ q, q)
    text = rep.pre_autograd[0].text
    assert "# l_q_: f32[1, 2, 8, 16] cpu" in text and ": None" not in text, text


@pytest.mark.parametrize("var, value", [("FXOPT_LOG", "bogus"), ("FXOPT_STATIC_LAUNCH", "no"),
                                        ("FXOPT_POISON_FREED", "yes")])
def test_bad_environment_values_name_the_variable(var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        Environment.read()


@pytest.mark.parametrize("var", ["FXOPT_DUMP", "FXOPT_CACHE_DIR"])
def test_an_unusable_directory_is_named_with_its_variable(var, tmp_path, monkeypatch):
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("")
    monkeypatch.setenv(var, str(a_file / "sub"))
    with pytest.raises(Exception, match=var):
        torch.compile(lambda x: (x * 2 + 1).sigmoid(), backend="fxopt")(torch.randn(3, 5))


def test_explain_a_graph_with_data_dependent_values():
    """With capture_scalar_outputs, `.item()` stays in the graph as an unbacked value: explain compiled the
    captured graphs after dynamo had returned, outside its tracing context, and aot_autograd failed
    (DataDependentOutputException) where torch.compile(backend="fxopt") works. Graphs now compile inside
    dynamo's backend call, as torch.compile's do."""
    def f(x):
        return x.sin() * x.sum().item() + 1

    x = torch.randn(6, 8)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        rep = fxopt.explain(f, x)
    assert rep.kernels and rep.graphs



def test_named_backend_with_options_leaves_parameters_swappable():
    """fxopt keeps no reference to the traced fake tensors: after `backend="fxopt", options={...}` the
    parameters have no weak references and `torch.utils.swap_tensors` takes them (with a callable backend
    dynamo itself keeps the fake tensors, for aot_eager as for fxopt: README, Use)."""
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.randn(4, 8)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="fxopt", options={"memory_plan": "apply"})(x)
    torch.testing.assert_close(out, model(x))
    weight = model[0].weight
    torch.utils.swap_tensors(weight, torch.nn.Parameter(torch.zeros(8, 8)))
    assert float(weight.abs().sum()) == 0.0


def test_dump_of_a_graph_run_as_aten_says_so_when_run(tmp_path):
    """A graph fxopt leaves to ATen (here a floor-divided symbolic size) dumps the ATen code with the reason;
    run on its own the file exited 0 and did nothing, as if it had checked something."""
    fn = lambda x: (x.reshape(x.shape[0] // 2, -1) * 2).sin()  # noqa: E731
    x = torch.randn(10, 4)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend=fxopt.backend(dump_dir=str(tmp_path)), dynamic=True)(x), fn(x))
    assert (tmp_path / "wrapper.py").read_text().startswith("# not generated: ")
    out = subprocess.run([sys.executable, str(tmp_path / "wrapper.py")], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert out.returncode != 0 and "runs as ATen ops" in out.stderr and "//2" in out.stderr, out.stderr[-1000:]

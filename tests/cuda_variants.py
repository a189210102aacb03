"""A pytest plugin for machines without a GPU: write the GPU ("cuda") variant of every fused group the
tests generate, as kernel files, for Triton's offline compile (codegen/offline_compile.py):

    FXOPT_CUDA_VARIANTS=/tmp/variants python -m pytest -q -p tests.cuda_variants tests
    python -m fxopt.codegen.offline_compile /tmp/variants          # compiles each for cuda:90

The tests themselves run as usual (the interpreter's variants); each distinct kernel is written once.
"""
import hashlib
import os


def install(on_kernel, set_attribute=setattr) -> None:
    """Make fxopt.compile also generate each fused group for "cuda" and hand it to `on_kernel`
    (combined casts have one variant: handed over as made). `set_attribute`: a MonkeyPatch's, to undo."""
    import fxopt.compile as compile_module

    def also_cuda(generate):
        def both(gm, name, target, *args):
            on_kernel(generate(gm, name, "cuda", *args))
            return generate(gm, name, target, *args)
        return both

    casts = compile_module.generate_combined_casts_kernel

    def casts_too(*args):
        kernel = casts(*args)
        on_kernel(kernel)
        return kernel

    set_attribute(compile_module, "generate_pointwise_kernel", also_cuda(compile_module.generate_pointwise_kernel))
    set_attribute(compile_module, "generate_reduction_kernel", also_cuda(compile_module.generate_reduction_kernel))
    set_attribute(compile_module, "generate_combined_casts_kernel", casts_too)


def pytest_configure(config):
    folder = os.environ.get("FXOPT_CUDA_VARIANTS")
    if not folder:
        return
    from fxopt.codegen.harness import standalone_source

    os.makedirs(folder, exist_ok=True)
    written = set()

    def write(k):
        digest = hashlib.sha1(k.full_source().encode()).hexdigest()[:12]
        if digest not in written:
            written.add(digest)
            with open(os.path.join(folder, f"{k.name}_{digest}.py"), "w") as f:
                f.write(standalone_source(k))

    install(write)

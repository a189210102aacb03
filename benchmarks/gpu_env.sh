# Source this on a machine without network where `pip install -e .` is not possible (the lent GPU):
# it puts the tree on PYTHONPATH and registers the "fxopt" torch.compile backend through a
# dist-info entry point, exactly as `pip install` would.
site=${TMPDIR:-/tmp}/fxopt-site
mkdir -p "$site/fxopt-0.1.0.dist-info"
printf 'Metadata-Version: 2.1\nName: fxopt\nVersion: 0.1.0\n' > "$site/fxopt-0.1.0.dist-info/METADATA"
printf '[torch_dynamo_backends]\nfxopt = fxopt.entry_point:fxopt_backend\n' > "$site/fxopt-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export FXOPT_CACHE_DIR=${FXOPT_CACHE_DIR:-${TMPDIR:-/tmp}/fxopt-cache}

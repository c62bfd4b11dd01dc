#!/usr/bin/env bash
# The whole test suite on a GPU machine (CUDA visible), e.g. the lent H200 with torch 2.11+cu130.
#
# Prepare on the host first (fills ./.whl with this project's and every plugin's wheels plus the pinned
# third-party wheels the device image lacks):   ../shared/gpu/prepare.sh
# Then run from the project root, carrying .whl:   COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_suite.sh
# (COMMIT is recorded when the copy on the device is not a git checkout; extra arguments go to pytest.)
#
# Installs the wheels into ./.site (no index, no dependencies), runs
#   python3 -m pytest -q -n $WORKERS -p no:cacheprovider
# from the root and writes under $OUT (default ./bench_out/gpu_suite):
#   gpu_suite.log   the full pytest output (-rfEs: failures, errors and skip reasons listed)
#   gpu_suite.json  counts, exit status, commit, GPU, torch/triton/diffusers versions, the command
# The last lines printed are the summary. Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-./bench_out}/gpu_suite"
mkdir -p "$out"
workers="${WORKERS:-8}"
log="$out/gpu_suite.log"

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    || { echo "installing .whl/*.whl failed" >&2; exit 1; }
  for packed in .whl/*.tar.xz; do  # wheels benchmarks/gpu_carry.sh packed smaller (their installed layout)
    [ -e "$packed" ] || continue
    tar -xJf "$packed" -C .site || { echo "unpacking $packed failed" >&2; exit 1; }
  done
  export PYTHONPATH="$PWD/.site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .whl/ here: using the installed packages (run ../shared/gpu/prepare.sh on the host for the device)" >&2
fi

# Distributions the suite needs besides the plugins: the core's own metadata (its `all` extra, its entry points), the
# out-of-tree example plugin and the test-only attention provider. A .whl/ without them (the core wheel is left out
# when FlashAttention-3's wheel would exceed the carry limit) gets them built here from the checkout, offline.
local_dists=(". worldfoundry" "docs/examples/third_party_plugin worldfoundry-example-gelu-tanh"
             "tests/fixtures/attention_provider_dist worldfoundry-test-attention-provider")
for entry in "${local_dists[@]}"; do
  read -r dir dist <<< "$entry"
  python3 -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$dist" 2>/dev/null && continue
  [ -f "$dir/pyproject.toml" ] || continue
  case ":${PYTHONPATH:-}:" in *":$PWD/.site:"*) ;; *) export PYTHONPATH="$PWD/.site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target .site "$dir" \
    || echo "building $dist from $dir failed: the tests that need it will fail" >&2
done

xdist=(-n "$workers")
python3 -c "import xdist" 2>/dev/null || { echo "pytest-xdist missing: running in one process" >&2; xdist=(); }
cmd=(python3 -m pytest -q "${xdist[@]}" -p no:cacheprovider -rfEs "$@")
echo "+ ${cmd[*]}" | tee "$log"
start=$(date +%s)
"${cmd[@]}" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
elapsed=$(( $(date +%s) - start ))

RC="$rc" ELAPSED="$elapsed" LOG="$log" CMD="${cmd[*]}" python3 - "$out/gpu_suite.json" <<'PY'
import json, os, re, subprocess, sys

def version(name):
    try:
        module = __import__(name)
        return getattr(module, "__version__", "?")
    except Exception as exc:  # report, never fail the summary
        return f"unavailable ({type(exc).__name__})"

def git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return None

text = open(os.environ["LOG"], encoding="utf-8", errors="replace").read()
summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
counts = {}
if summary:
    for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)", summary[-1]):
        counts[kind.rstrip("s") if kind.startswith(("error", "warning")) else kind] = int(number)
gpu = None
try:
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device visible"
except Exception as exc:
    gpu = f"torch unavailable ({exc})"
result = {
    "exit_status": int(os.environ["RC"]),
    "counts": counts,
    "summary_line": summary[-1] if summary else None,
    "failed": re.findall(r"^FAILED (\S+)", text, flags=re.M),
    "errors": re.findall(r"^ERROR (\S+)", text, flags=re.M),
    "elapsed_s": int(os.environ["ELAPSED"]),
    "command": os.environ["CMD"],
    "commit": git("rev-parse", "HEAD") or os.environ.get("COMMIT"),
    "dirty": bool(git("status", "--porcelain")) if git("rev-parse", "HEAD") else None,
    "gpu": gpu,
    "versions": {name: version(name) for name in ("torch", "triton", "diffusers", "transformers")},
}
with open(sys.argv[1], "w", encoding="utf-8") as fh:
    json.dump(result, fh, indent=2)
print()
print(f"gpu suite: {result['summary_line']}  (exit {result['exit_status']}, {result['elapsed_s']} s)")
print(f"  gpu {gpu}; torch {result['versions']['torch']}; commit {result['commit']}")
for name in result["failed"] + result["errors"]:
    print(f"  not green: {name}")
PY
exit "$rc"

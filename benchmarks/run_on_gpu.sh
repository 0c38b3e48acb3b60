#!/usr/bin/env bash
# The GPU figures of the project in one command of at most 9 minutes, on an offline GPU machine (issue 25, part 3):
#
#     bash benchmarks/run_on_gpu.sh OUT_DIR                    # the swarms at target batch = batch
#     GPU_TARGETS=128 bash benchmarks/run_on_gpu.sh OUT_DIR    # a second command: at target batch 128
#     GPU_TARGETS=128 GPU_OVERLAP="on off" bash ...             # each swarm with overlap_batches on, then off
#
# run in the checkout's root, with the wheels the machine lacks in .whl/ (../shared/gpu/README.md: here, once,
# `bash ../shared/gpu/fetch_wheels.sh`, then `bash benchmarks/run_on_gpu.sh --fetch-test-wheels` for pytest and
# psutil, which the GPU tests need and that script does not fetch). On the device: a `run` carrying [".whl"] whose
# command is `bash benchmarks/run_on_gpu.sh $OUT`. Steps, in this order, each under its own time limit, its output
# in OUT_DIR/<step>.log, its exit status and seconds in OUT_DIR/summary.txt; a failed step is recorded and the next
# one runs:
#
#   install     the carried wheels into /tmp/site (skipped without .whl/)
#   imports     torch with CUDA, hivemind, bitsandbytes (a blockwise quantization on the GPU), pyzmq, lightning,
#               lightning_swarm; pytest and psutil for the tests. Without CUDA or lightning_swarm nothing else runs.
#   calibrate   one stage's forward and backward per sample on this GPU (gpu.py --calibrate): the figures
#               gpu_proxy.py's calibration takes from the H100
#   optimizer_host  the stage optimizer's work per backward and per step, hivemind's per-tensor loops against the
#               multi-tensor calls, and a round's copies, hivemind's through pageable memory against ours through
#               pinned memory, d_model 1024 and 2048 (optimizer_host.py)
#   gpu         gpu.py: d_model 2048 and 1024, 32-true and bf16-mixed, plain training and the swarm at the targets of
#               GPU_TARGETS (default: batch, a step every batch; all four configurations take ~300 s on an H200, so
#               target 128 needs a command of its own); 4 and "auto" microbatches in each swarm ("auto" timed once
#               tuned; 8 was the slowest setting in every configuration on the H200, 2026-11-27); the time left after
#               reserving the later steps' limits (--budget), runs in order of priority; --trace: each phase's
#               requests split into parts (transfer, decode, queue, serve, reply) in gpu.log and the JSON
#   stage_memory  one stage's device memory, d_model 2048, 8 batches, a step every 4: 32-true, 32-true again with
#               PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (on an H200 half a stage's reserved memory was the
#               caching allocator's, 2026-11-28: does this setting take it back?), then bf16-mixed
#   out_of_core   a stage of 12 blocks of d_model 2048 resident and out of core at 2x and 4x its memory cap: samples/s,
#               compute and step time apart
#   gpu_tests   the tests that need a GPU (tests/unit/test_compression.py, test_memory.py, test_device_sync.py)
#   flooding    benchmarks/flooding.py --pairs 2 --steps 40 on this machine's CPU cores (issue 25's flooding target: a
#               trainer beside a flooding caller keeps 0.8 of its solo rate; on 2 shared cores it kept 0.49-0.55, and
#               the profile blamed the cores all processes share); last but one, only with FLOODING_LIMIT seconds left
#   proxy       gpu_proxy.py --quick (d_model 1024, 2 and 4 microbatches, a step every batch, the H100 calibration)
#               on this machine's CPU, to hold against the gpu step's d_model 1024 32-true swarm and the calibration;
#               last, and only with PROXY_LIMIT seconds left (it took over 70 s on the H200's host)
#
# Results: OUT_DIR/RESULTS.md (the gpu, optimizer_host, out_of_core and gpu_proxy sections), OUT_DIR/summary.txt
# and, packed in OUT_DIR/all.tgz (the device sends back a few files only), the logs, stage_memory_<precision>[_expandable].json and
# results/*.json: unpacked here (`tar xzf <files_at>/all.tgz -C DIR`), merge them with `python benchmarks/gpu.py
# --merge DIR/results/gpu.json` and `python benchmarks/out_of_core.py --merge DIR/results/out_of_core.json`. Every
# process a step starts carries a mark in its environment: those still alive after the step (peers in sessions of
# their own, their p2pd) are killed, so that none holds GPU memory in the next step. Budget: 540 s in all (the
# device allows 600 s a command); the limits below are upper bounds, and what the steps before it leave unused goes
# to the gpu step. The limits are set from an H200 run's summary.txt (below).
set -uo pipefail

if [[ ${1:-} == --fetch-test-wheels ]]; then  # here, with the registries: what the GPU tests need beyond the benchmarks
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pytest pluggy iniconfig pygments psutil  # packaging: lightning brings it
  exit
fi
out=${1:?usage: bash benchmarks/run_on_gpu.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2

TOTAL=540                 # seconds for the whole command
GRACE=10                  # a step past its limit gets SIGTERM, then SIGKILL this much later
# measured on an H200 (2026-11-27): install 2 s, imports 28, calibrate 23, one stage_memory run of 8 batches 22,
# out_of_core 36, gpu_tests 36; the proxy ran past 70
declare -A LIMIT=([install]=30 [imports]=40 [calibrate]=30 [optimizer_host]=60 [stage_memory]=90 [out_of_core]=50
  [gpu_tests]=45)
LATER=(stage_memory out_of_core gpu_tests)  # what the gpu step leaves time for
FLOODING_LIMIT=90
PROXY_LIMIT=80
start=$SECONDS
summary=$out/summary.txt
: > "$summary"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
export RUN_ON_GPU_MARK="$$.$RANDOM"

# Kill every process but this script that carries this run's mark (peers outliving a launcher stopped on time).
stop_leftovers() {
  python3 - "$$" <<'PY'
import os, signal, sys
mark, keep = os.environ["RUN_ON_GPU_MARK"], {os.getpid(), os.getppid(), int(sys.argv[1])}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            marked = f"RUN_ON_GPU_MARK={mark}".encode() in f.read().split(b"\0")
        if marked and int(pid) not in keep:
            os.kill(int(pid), signal.SIGKILL)
            print(f"killed leftover process {pid}")
    except (OSError, ValueError):
        pass
PY
}

# step NAME LIMIT COMMAND...: run COMMAND under LIMIT seconds (never past the whole command's end), its output in
# NAME.log, and record its exit status (124: past its limit) and seconds.
step() {
  local name=$1 limit=$2 began=$SECONDS rc
  shift 2
  local left=$((TOTAL - (SECONDS - start) - GRACE))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    printf '%-13s skipped: no time left\n' "$name" | tee -a "$summary"
    return 1
  fi
  echo "== $name (at most ${limit}s): $*"
  timeout -k "$GRACE" "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  stop_leftovers >> "$out/$name.log" 2>&1
  printf '%-13s rc=%-3s %4ds  (limit %ds)%s\n' "$name" "$rc" $((SECONDS - began)) "$limit" \
    "$( ((rc == 124 || rc == 137)) && echo '  TIMED OUT')" | tee -a "$summary"
  tail -n 5 "$out/$name.log"
  return "$rc"
}

if [[ -d .whl ]]; then
  step install "${LIMIT[install]}" python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/site .whl/*.whl
fi
step imports "${LIMIT[imports]}" python3 - <<'PY'
import importlib, sys
failed = []
def check(name, test=None):
    try:
        module = importlib.import_module(name)
        detail = test(module) if test else getattr(module, "__version__", "")
        print(f"ok      {name} {detail}")
    except Exception as e:  # noqa: BLE001 - every failure is reported, the others still checked
        failed.append(name)
        print(f"FAILED  {name}: {e!r}")
def cuda(torch):
    assert torch.cuda.is_available(), "no CUDA device"
    return f"{torch.__version__}, {torch.cuda.get_device_name(0)}"
def blockwise(bnb):
    import torch
    from bitsandbytes.functional import dequantize_blockwise, quantize_blockwise
    x = torch.randn(4096, device="cuda")
    q, state = quantize_blockwise(x)
    assert (dequantize_blockwise(q, state) - x).abs().max() < 0.1
    return f"{bnb.__version__}, blockwise 8-bit on the GPU"
check("torch", cuda)
if failed:  # no GPU: nothing to measure (and no reason to wait for the other imports)
    sys.exit(2)
for name, test in [("hivemind", None), ("bitsandbytes", blockwise), ("zmq", None), ("lightning", None),
                   ("lightning_swarm", lambda m: m.__file__), ("pytest", None), ("psutil", None)]:
    check(name, test)
# without CUDA or the project nothing else can run: exit 2; a missing test dependency only fails that step (1)
sys.exit(2 if {"torch", "lightning_swarm", "hivemind"} & set(failed) else 1 if failed else 0)
PY
if (($? == 2)); then
  echo "imports failed: nothing else can run (see $out/imports.log)" | tee -a "$summary"
  exit 1
fi

step calibrate "${LIMIT[calibrate]}" python3 benchmarks/gpu.py --calibrate --out "$out/RESULTS.md"

step optimizer_host "${LIMIT[optimizer_host]}" python3 benchmarks/optimizer_host.py --cycles 20 --out "$out/RESULTS.md"

reserve=$((${#LATER[@]} * GRACE + 5))
for name in "${LATER[@]}"; do reserve=$((reserve + LIMIT[$name])); done
gpu_limit=$((TOTAL - (SECONDS - start) - reserve - GRACE))
# its last run stops its peers and saves its figures after its budget: 20 s for that inside the step's limit
step gpu "$gpu_limit" python3 benchmarks/gpu.py --out "$out/RESULTS.md" --d-model 2048 1024 \
  --precision 32-true bf16-mixed --updates synchronous --targets ${GPU_TARGETS:-batch} --overlap ${GPU_OVERLAP:-on} \
  --microbatches 4 auto \
  --budget $((gpu_limit - 20)) --timeout 120 --trace

step stage_memory "${LIMIT[stage_memory]}" bash -c 'rc=0; for run in 32-true 32-true_expandable bf16-mixed; do
  conf=${PYTORCH_CUDA_ALLOC_CONF-}; [[ $run == *_expandable ]] && conf=expandable_segments:True
  PYTORCH_CUDA_ALLOC_CONF=$conf python3 benchmarks/stage_memory.py --d-model 2048 --precision ${run%_expandable} \
    --batches 8 --step-every 4 --out "$0/stage_memory_$run.json" || rc=$?; done; exit $rc' "$out"

step out_of_core "${LIMIT[out_of_core]}" python3 benchmarks/out_of_core.py --out "$out/RESULTS.md" \
  --d-model 2048 --blocks 12 --warmup 2 --batches 6 --step-every 2

step gpu_tests "${LIMIT[gpu_tests]}" python3 -m pytest -p no:cacheprovider -o addopts= -q -rs -k "gpu or device" \
  tests/unit/test_compression.py tests/unit/test_memory.py tests/unit/test_device_sync.py

if ((TOTAL - (SECONDS - start) - GRACE >= FLOODING_LIMIT)); then
  step flooding "$FLOODING_LIMIT" bash -c 'mkdir -p "$0/results" && python3 benchmarks/flooding.py --pairs 2 --steps 40 &&
    cp benchmarks/results/flooding.json "$0/results/flooding.json"' "$out"
else
  printf '%-13s skipped: fewer than %ds left\n' flooding "$FLOODING_LIMIT" | tee -a "$summary"
fi

if ((TOTAL - (SECONDS - start) - GRACE >= PROXY_LIMIT)); then
  step proxy "$PROXY_LIMIT" python3 benchmarks/gpu_proxy.py --quick --timeout 50 --out "$out/RESULTS.md"
else
  printf '%-13s skipped: fewer than %ds left\n' proxy "$PROXY_LIMIT" | tee -a "$summary"
fi

printf 'all steps: %ds of %ds\n' $((SECONDS - start)) "$TOTAL" | tee -a "$summary"
# the device sends back a few files only: everything but the summary and RESULTS.md in one archive
# (written beside the folder first: tar warns of a folder that changes while it reads it)
(cd "$out" && tar czf "$out.tgz" --exclude=summary.txt --exclude=RESULTS.md . && mv "$out.tgz" all.tgz &&
  find . -mindepth 1 -maxdepth 1 ! -name all.tgz ! -name summary.txt ! -name RESULTS.md -exec rm -rf {} +)

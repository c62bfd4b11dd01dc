#!/usr/bin/env bash
# resident_blocks baseline: every DiT block streams through two device slots (r = 0,
# recipes/residency/baseline.json). Same checkpoint, task, prompt, size, seed, steps, dtype and layout as
# run_resident.sh. Edit the values below; paths are examples.

worldfoundry_path=/path/to/worldfoundry
checkpoint_dir=/path/to/Wan2.1-T2V-1.3B-Diffusers   # empty: seeded random weights (speed only)
recipe=wan2.1-t2v-1.3b
device=cuda
dtype=bfloat16
prompt="a red panda eating bamboo in a misty forest"
frames=17
height=320
width=576
steps=50
seed=42

config="${worldfoundry_path}/recipes/residency/baseline.json"
output="${worldfoundry_path}/save_results/resident_blocks_baseline.mp4"
if [ -n "${checkpoint_dir}" ]; then weights=(--checkpoint-dir "${checkpoint_dir}"); else weights=(--random-weights); fi

mkdir -p "${worldfoundry_path}/save_results"
python -m worldfoundry.cli.main generate \
    --recipe "${recipe}" "${weights[@]}" \
    --prompt "${prompt}" --frames "${frames}" --height "${height}" --width "${width}" \
    --steps "${steps}" --seed "${seed}" --device "${device}" --dtype "${dtype}" \
    --accelerations "{\"resident_blocks\": {\"config\": \"${config}\"}}" \
    --out "${output}"

#!/usr/bin/env bash
# resident_blocks with the estimator's r: estimate once (when the config does not exist yet), then generate.
# Same checkpoint, task, prompt, size, seed, steps, dtype and layout as run_baseline.sh. Edit the values
# below; paths are examples. Delete save_results/resident_blocks_config.json to estimate again (needed after
# a change of device, weights, size, dtype, layout or kernels); you may lower its r by hand.

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

config="${worldfoundry_path}/save_results/resident_blocks_config.json"
output="${worldfoundry_path}/save_results/resident_blocks_resident.mp4"
if [ -n "${checkpoint_dir}" ]; then weights=(--checkpoint-dir "${checkpoint_dir}"); else weights=(--random-weights); fi

mkdir -p "${worldfoundry_path}/save_results"
if [ ! -f "${config}" ]; then
    python -m worldfoundry.cli.main estimate-residency \
        --recipe "${recipe}" "${weights[@]}" \
        --frames "${frames}" --height "${height}" --width "${width}" \
        --device "${device}" --dtype "${dtype}" \
        --out "${worldfoundry_path}/save_results" || exit 1
fi
python -m worldfoundry.cli.main generate \
    --recipe "${recipe}" "${weights[@]}" \
    --prompt "${prompt}" --frames "${frames}" --height "${height}" --width "${width}" \
    --steps "${steps}" --seed "${seed}" --device "${device}" --dtype "${dtype}" \
    --accelerations "{\"resident_blocks\": {\"config\": \"${config}\"}}" \
    --out "${output}"

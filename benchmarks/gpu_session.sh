#!/usr/bin/env bash
# One device call = one run of this script: installs the carried wheels, then runs the named stages in order,
# each under its own time limit, logging to $OUT/<stage>.log and printing a short summary at the end.
#   bash benchmarks/gpu_session.sh env gputests kernels latency35 ...
# Stages are listed in stage_* functions below. Needs: .whl/ carried (fla-core, fastapi stack) and .bench_assets/
# for the serve stages; scripts/prepare_device_assets.sh fills both.
set -uo pipefail
# Stages write under a work folder; after every stage it is packed into $OUT/results.tgz (the device tool
# brings back at most 8 files) and the summary is copied next to it, so a run cut short still returns data.
FINAL=${OUT:-/tmp/out}
OUT=/tmp/nibble_work
# a machine may be lent again with an earlier call's work folder still there: start empty, so that no older
# file is packed with this call's results
rm -rf "$OUT"
mkdir -p "$OUT" "$FINAL"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
M=benchmarks/models
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"

run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $((SECONDS - t0))s" | tee -a "$SUMMARY"
  tail -n 25 "$OUT/$name.log" >> "$SUMMARY"
  pack
}
pack() { tar czf "$FINAL/results.tgz" -C "$OUT" . 2>/dev/null; cp "$SUMMARY" "$FINAL/summary.txt"; }

stage_versions() {
  run versions 30 python3 -c "import torch, triton, transformers, fla; print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, fla.__version__)"
}
stage_env() {
  run env 60 bash -c 'nvidia-smi; python3 -c "import torch, triton, transformers, fla; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, fla.__version__)"'
}
stage_gputests() { NIBBLE_TEST_GPU=1 run gputests 420 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -p no:cacheprovider -rf; }
stage_enginetests() { NIBBLE_TEST_GPU=1 run enginetests 360 python3 -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider -rf; }
stage_nonmoetests() { NIBBLE_TEST_GPU=1 run nonmoetests 300 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "norms or paged or conv1d or gated_delta or chunk_plan or elementwise or route or nvfp4_linear or fused_moe_nvfp4_dtypes" -p no:cacheprovider -rf; }
stage_biastest() { NIBBLE_TEST_GPU=1 run biastest 120 python3 -m pytest -q tests/gpu/test_engine_gpu.py -k "logit_bias or structured" -p no:cacheprovider -rf; }
stage_normtests() { NIBBLE_TEST_GPU=1 run normtests 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "norms or elementwise or select_kernels" -p no:cacheprovider -rf; }
stage_gdntests() { NIBBLE_TEST_GPU=1 run gdntests 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "gated_delta or select_kernels" -p no:cacheprovider -rf; }
stage_countertests() { NIBBLE_TEST_GPU=1 run countertests 240 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "nvfp4_dtypes or cuda_graph_replay or pdl_matches" -p no:cacheprovider -rf; }
stage_w4tests() { NIBBLE_TEST_GPU=1 run w4tests 300 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "moe or nvfp4_linear" -p no:cacheprovider -rf; }
stage_densetests() { NIBBLE_TEST_GPU=1 run densetests 240 python3 -m pytest -q tests/gpu/test_dense_gemv_gpu.py -p no:cacheprovider -rf; }
stage_densegemv() {  # F.linear against the dense GEMV on every 16-bit decode projection shape; table entries from it
  run densegemv 360 python3 benchmarks/dense_gemv_bench.py --out "$OUT/dense.json" --write-table "$OUT/dense_table.json"
  # the entries go into this GPU's own table in this checkout, for the stages after this one (densee2e)
  run densetable 30 python3 benchmarks/install_tuning_entries.py dense_linear "$OUT/dense_table.json"
}
gpu_key() { python3 -c "from nibble.kernels._triton import device_key; print(device_key('cuda:0'))"; }  # tables' name
# Stages that time the engine with a changed tuning table work on this GPU's table file in the checkout ($TABLE after
# table_save) and put it back with table_restore (removed again if the GPU had none)
table_save() {
  TABLE=nibble/kernels/tuning/$(gpu_key).json
  if [ -f "$TABLE" ]; then cp "$TABLE" /tmp/table_saved.json; else rm -f /tmp/table_saved.json; fi
}
table_restore() {
  if [ -f /tmp/table_saved.json ]; then cp /tmp/table_saved.json "$TABLE"; else rm -f "$TABLE"; fi
}
decode_latency() {  # decode_latency NAME LIMIT_S MODEL [FLAGS...]: decode steps at batch 1, 4, 8 after 1024-token prompts
  local name=$1 limit=$2 model=$3; shift 3
  run "$name" "$limit" python3 -m nibble.cli bench latency --model "$M/$model" --load-format dummy \
    --batch-sizes 1,4,8 --input-len 1024 --output-len 64 --max-num-seqs 8 "$@" --output-json "$OUT/$name.json"
}
profile_b1() {  # profile_b1 NAME MODEL: where a batch-1 decode step's time goes (CUDA-graph replay, kernels per step)
  run "$1" 240 python3 benchmarks/profile_decode.py --model "$M/$2" --batch-sizes 1 --out "$OUT/$1"
}
stage_densee2e() {  # 122B decode steps with the dense GEMV (the table), with cuBLAS (--linear-backend torch), with it again
  decode_latency densee2e_on 170 Qwen3.5-122B-A10B-NVFP4
  decode_latency densee2e_off 170 Qwen3.5-122B-A10B-NVFP4 --linear-backend torch
  decode_latency densee2e_on2 170 Qwen3.5-122B-A10B-NVFP4
}
stage_densee2e35() {  # 35B decode steps with the dense GEMV (the table) and with cuBLAS (--linear-backend torch)
  decode_latency densee2e35_on 150 Qwen3.5-35B-A3B-NVFP4
  decode_latency densee2e35_off 150 Qwen3.5-35B-A3B-NVFP4 --linear-backend torch
}
stage_profile122b1() { profile_b1 profile122b1 Qwen3.5-122B-A10B-NVFP4; }
stage_selecttest() { NIBBLE_TEST_GPU=1 run selecttest 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k select_kernels -p no:cacheprovider -rf; }
stage_densepdl() {  # decode steps with the dense GEMV launched with PDL (default), without, with again; 122B where it fits
  local model=Qwen3.5-35B-A3B-NVFP4
  python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory < 100 * 2**30)" \
    && model=Qwen3.5-122B-A10B-NVFP4
  table_save
  for v in on off on2; do
    table_restore
    [ "$v" = off ] && python3 -c "
import json, sys
t = json.load(open(sys.argv[1]))
for e in t['dense_linear']:
    e['config']['pdl'] = False
json.dump(t, open(sys.argv[1], 'w'))" "$TABLE"
    decode_latency densepdl_$v 170 $model
  done
  table_restore
}
stage_flatables() {  # fla-core's configs for this GPU (fla_tables.py): autotuned and stored, then cold self-tests without / with
  local key
  key=$(gpu_key)
  TRITON_CACHE_DIR=$(mktemp -d) run flawrite 480 python3 benchmarks/fla_tables.py write --models 122B,35B \
    --tp "${FLA_TP:-1,2,4,8}" --json "$OUT/flawrite.json"
  mkdir -p "$OUT/fla_tables" && cp -r "nibble/kernels/tuning/fla/$key" "$OUT/fla_tables/"
  FLA_CACHE_MODE=disabled TRITON_CACHE_DIR=$(mktemp -d) run flaselect_off 240 python3 benchmarks/fla_tables.py select \
    --model 122B --json "$OUT/flaselect_off.json"
  TRITON_CACHE_DIR=$(mktemp -d) run flaselect_on 240 python3 benchmarks/fla_tables.py select --model 122B \
    --json "$OUT/flaselect_on.json"
}
stage_flacold() {  # cold Triton cache with the stored fla configs: self-tests of the 35B, then an engine start and decode steps
  TRITON_CACHE_DIR=$(mktemp -d) run flacold_select 240 python3 benchmarks/fla_tables.py select --model 35B \
    --json "$OUT/flacold_select.json"
  TRITON_CACHE_DIR=$(mktemp -d) decode_latency flacold_e2e 300 Qwen3.5-35B-A3B-NVFP4
  grep -h "gated_delta_rule: \|self-tests" "$OUT/flacold_e2e.log" | tee -a "$SUMMARY"
}
stage_siblingtable() {  # a GPU without MoE / attention entries of its own: its capability's table (H200's) vs default.json
  local v
  for v in sibling default; do
    [ "$v" = default ] && mv nibble/kernels/tuning/by_capability.json /tmp/by_capability.json
    run moetable_$v 200 python3 benchmarks/moe_bench.py --models 122B,35B --tokens 1,4,16,64,256,2048 --only "^auto$" \
      --out "$OUT/moetable_$v.json"
    run attntable_$v 240 python3 benchmarks/attention_prefill_bench.py --sweep "" --out "$OUT/attntable_$v.json"
  done
  mv /tmp/by_capability.json nibble/kernels/tuning/by_capability.json
}
stage_normtriggertests() { NIBBLE_TEST_GPU=1 run normtriggertests 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "norms or elementwise" -p no:cacheprovider -rf; }
stage_moetests() { NIBBLE_TEST_GPU=1 run moetests 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k moe -p no:cacheprovider -rf; }
stage_moe() {
  run moe 450 python3 benchmarks/moe_bench.py --models 122B,35B --tokens 1,2,4,8,16,32,64,128,256,2048 --sweep \
    --budget-s 350 --out "$OUT/moe.json"
}
stage_moeauto() {  # the tuning table's choice only (with the shift decode beside it), decode sizes of both big layers
  run moeauto 120 python3 benchmarks/moe_bench.py --models 122B,397B --tokens 1,2,4,8,16,32,64,128,256 \
    --only '^auto(:shift-decode)?$' --out "$OUT/moeauto.json"
}
stage_moepdlsmall() {  # the table's choice with and without PDL / the L2 prefetches at 1-4 tokens (the latency-bound sizes)
  run moepdlsmall 150 python3 benchmarks/moe_bench.py --models 122B,397B --tokens 1,2,4 --reps 20 --profile \
    --only '^auto(:no-pdl|:dn-prefetch|:gu-prefetch)?$' --out "$OUT/moepdlsmall.json"
}
stage_moepdl() {  # the table's choice with and without PDL / L2 prefetch, decode sizes of both big layers
  run moepdl 330 python3 benchmarks/moe_bench.py --models 122B,397B --tokens 1,2,4,8,16,32,64,128,256 \
    --only '^auto(:no-pdl|:dn-prefetch|:gu-prefetch|:no-dn-prefetch)?$' \
    --out "$OUT/moepdl.json"
}
stage_moetma() {  # the table's choice with weight tiles by TMA (2: units and scales; gate_up, down, the mixed
  # path's split-16 tile alone, and deeper pipelines), decode and prefill sizes, twice
  local all='"gu_tma": 2, "dn_tma": 2, "lg_gu_tma": 2, "lg_dn_tma": 2'
  for r in 1 2; do
    run "moetma_r$r" 240 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 8,32,64,128,256,512,2048 \
      --only '^auto$' --variant "tma2={$all}" --variant 'gu-tma2={"gu_tma": 2, "lg_gu_tma": 2}' \
      --variant 'dn-tma2={"dn_tma": 2, "lg_dn_tma": 2}' --variant 'lg-tma2={"lg_gu_tma": 2, "lg_dn_tma": 2}' \
      --variant "tma2-s4={$all, \"gu_stages\": 4, \"dn_stages\": 4, \"lg_gu_stages\": 4, \"lg_dn_stages\": 4}" \
      --out "$OUT/moetma_r$r.json"
  done
}
stage_moetmatable() {  # the table's choice (TMA gate_up in split-16 tiles, TMA in the prefill tiles) against it
  # without TMA, from 128 tokens up, twice
  for r in 1 2; do
    run "moetmatable_r$r" 240 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 128,256,512,1024,2048,8192 \
      --only '^auto$' --variant 'no-tma={"gu_tma": 0, "dn_tma": 0, "lg_gu_tma": 0, "lg_dn_tma": 0}' \
      --out "$OUT/moetmatable_r$r.json"
  done
}
stage_moetmasweep() {  # prefill tiles with TMA: deeper pipelines, BLOCK_K 256 (scales by TMA too), 128 token
  # slots; the mixed decode tiles with the split-16 gate_up by TMA, also from 4 pairs per expert on
  local p='"gu_tma": 2, "dn_tma": 2'
  run moetmasweep_pf 300 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 2048,8192 --only '^auto$' \
    --variant "p-s4={$p, \"gu_stages\": 4, \"dn_stages\": 4}" \
    --variant "p-bk256={$p, \"gu_block_k\": 256, \"dn_block_k\": 256}" \
    --variant "p-bk256-s2={$p, \"gu_block_k\": 256, \"dn_block_k\": 256, \"gu_stages\": 2, \"dn_stages\": 2}" \
    --variant "p-bt128={$p, \"block_t\": 128}" \
    --variant "p-bt128-s2={$p, \"block_t\": 128, \"gu_stages\": 2, \"dn_stages\": 2}" \
    --out "$OUT/moetmasweep_pf.json"
  run moetmasweep_mx 200 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 96,128,192 --only '^auto$' \
    --variant 'lg-gu-tma={"lg_gu_tma": 2}' --variant 'mx3-lg-gu-tma={"lg_gu_tma": 2, "mixed_max_pairs": 3}' \
    --out "$OUT/moetmasweep_mx.json"
}
stage_moetmagu() {  # split-16 gate_up tiles with TMA (the table's is 64 rows, 8 warps, 3 stages), 256-512 tokens, twice
  for r in 1 2; do
    run "moetmagu_r$r" 200 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 256,384,512 --only '^auto$' \
      --variant 'g32w4={"gu_block_n": 32, "gu_warps": 4}' --variant 'g32w4s4={"gu_block_n": 32, "gu_warps": 4, "gu_stages": 4}' \
      --variant 'gs4={"gu_stages": 4}' --variant 'g128={"gu_block_n": 128}' \
      --variant 'g128s4={"gu_block_n": 128, "gu_stages": 4}' --out "$OUT/moetmagu_r$r.json"
  done
}
stage_tailtests() { NIBBLE_TEST_GPU=1 run tailtests 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "nvfp4_linear or select_kernels" -p no:cacheprovider -rf; }
stage_tmatests() { NIBBLE_TEST_GPU=1 run tmatests 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k tma_matches_pointer -p no:cacheprovider -rf; }
stage_moepair() {  # the table's choice with DEC 4 (converter decode without the byte permute) vs DEC 3
  run moepair 200 python3 benchmarks/moe_bench.py --models 122B,397B --tokens 1,2,4,8,16,32,64,128,256 \
    --only "^auto(:byte-permute)?$" --out "$OUT/moepair.json"
}
stage_moemixed() {  # quad-4 blocks for experts with few pairs, split-16 for the others, against the table
  run moemixed 300 python3 benchmarks/moe_bench.py --models 122B,397B --tokens 32,64,128,256,512 \
    --only "^auto$|^mix" --out "$OUT/moemixed.json"
}
stage_moepairtile() {  # quad-4 / quad-8 / split-16 tiles with DEC 4 at 2-8 pairs per expert
  run moepairtile 300 python3 benchmarks/moe_bench.py --models 122B,397B --tokens 64,128,256 --sweep \
    --only "^srt:quad4/gu32x256w4s4/dn64x256w4s4$|^srt:quad8/gu32x256w4s4/dn64x256w4s4$|^srt:split16/gu(64x256w8|32x256w4)s4/dn64x256w4s4$" \
    --out "$OUT/moepairtile.json"
}
stage_isarates() {  # issue rates of the decode's SASS instructions and of the decodes alone (benchmarks/isa_rates.py)
  run isarates 120 python3 benchmarks/isa_rates.py --out "$OUT/isarates.json"
}
stage_moeprobe() {  # where the time of a small-T layer goes (benchmarks/moe_probe.py)
  run moeprobe 150 python3 benchmarks/moe_probe.py --models 122B,397B --tokens 1,2,4
}
stage_moetile() {  # sorted-path tiles at 4-8 pairs per expert
  run moetile 300 python3 benchmarks/moe_bench.py --models 122B,397B --tokens 64,128,256 --sweep \
    --only "^srt:(split|perm)(16|32)|^srt:quad8" --out "$OUT/moetile.json"
}
stage_moedn1() {  # 1-4 tokens: the table's choice against the top-k sum by a separate reduce launch, twice
  local v
  for v in a b; do
    run moedn1$v 200 python3 benchmarks/moe_bench.py --models 122B,35B,397B --tokens 1,2,3,4 --only '^auto$' --reps 40 \
      --variant 'dnreduce={"dn_mode": "reduce"}' --variant 'dnreduce256={"dn_mode": "reduce", "dn_block_k": 256}' \
      --out "$OUT/moedn1$v.json"
  done
}
stage_moebt() {  # the pairs path with 1 or 2 token slots per program in quad mode (MMAs narrower than 8 columns), twice,
  # at $MOEBT_TOKENS (the thirty-second session's `moebt8` stage: 1-8)
  local v
  for v in a b; do
    run moebt$v 200 python3 benchmarks/moe_bench.py --models 122B,35B,397B --tokens "${MOEBT_TOKENS:-1,2,4,7}" --only '^auto$' \
      --reps 40 --variant 'bt1={"block_t": 1}' --variant 'bt2={"block_t": 2}' --out "$OUT/moebt$v.json"
  done
}
stage_moegemvbt() {  # 3-16 tokens: the table against the per-pair path with 1 or 2 token slots and the sorted path with 2
  local g='"path": "gemv", "xmode": "quad", "gu_block_n": 16, "gu_block_k": 256, "gu_warps": 2, "gu_stages": 4, "dn_mode": "reduce", "dn_block_n": 32, "dn_block_k": 256, "dn_warps": 2, "dn_stages": 3'
  run moegemvbt 240 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens ${MOEGEMV_TOKENS:-3,6,7,8,10,12,16} --only '^auto$' \
    --reps 40 --variant "gemv2={$g, \"block_t\": 2}" --variant "gemv1={$g, \"block_t\": 1}" \
    --variant 'srt2={"block_t": 2}' --out "$OUT/moegemvbt.json"
}
stage_moebt2tiles() {  # 1-5 tokens: per-pair tiles again with 2 token slots (warps, widths, pipeline depths)
  local b='"block_t": 2'
  run moebt2tiles 240 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 1,2,3,4,5 --only '^auto$' --reps 40 \
    --variant "g32w4={$b, \"gu_block_n\": 32, \"gu_warps\": 4}" --variant "gw1={$b, \"gu_warps\": 1}" \
    --variant "gw4={$b, \"gu_warps\": 4}" --variant "gs3={$b, \"gu_stages\": 3}" --variant "gs6={$b, \"gu_stages\": 6}" \
    --variant "d64w4={$b, \"dn_block_n\": 64, \"dn_warps\": 4}" --variant "dw1={$b, \"dn_warps\": 1}" \
    --variant "dk128={$b, \"dn_block_k\": 128, \"dn_stages\": 4}" --variant "dk256={$b, \"dn_block_k\": 256, \"dn_stages\": 3}" \
    --variant "fused={$b, \"dn_mode\": \"fused\"}" --variant "reduce={$b, \"dn_mode\": \"reduce\"}" \
    --out "$OUT/moebt2tiles.json"
}
stage_moet1tiles() {  # 1-3 tokens: down's K step and the tiles around the 1-token winner (2 slots, BLOCK_K 256 for down)
  local b='"block_t": 2' d='"dn_block_k": 256, "dn_stages": 3'
  run moet1tiles 240 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 1,2,3 --only '^auto$' --reps 40 \
    --variant "dk512={$b, \"dn_block_k\": 512, \"dn_stages\": 2}" --variant "dk256s4={$b, \"dn_block_k\": 256, \"dn_stages\": 4}" \
    --variant "dk256s2={$b, \"dn_block_k\": 256, \"dn_stages\": 2}" --variant "dk256gs3={$b, $d, \"gu_stages\": 3}" \
    --variant "dk256d64w4={$b, $d, \"dn_block_n\": 64, \"dn_warps\": 4}" --variant "dk256dw1={$b, $d, \"dn_warps\": 1}" \
    --variant "dk256reduce={$b, $d, \"dn_mode\": \"reduce\"}" --variant "dk256g32w4={$b, $d, \"gu_block_n\": 32, \"gu_warps\": 4}" \
    --variant "gk512={$b, \"gu_block_k\": 512, \"gu_stages\": 2}" --variant "gk128={$b, \"gu_block_k\": 128, \"gu_stages\": 6}" \
    --out "$OUT/moet1tiles.json"
}
stage_tablee2e() {  # decode steps of $TABLE_MODEL (default 35B) with this checkout's table, with $TABLE_OLD (a table file
  # brought along) in its place, with this checkout's again
  local model=${TABLE_MODEL:-Qwen3.5-35B-A3B-NVFP4}
  table_save
  decode_latency tablee2e_new 170 "$model"
  cp "$TABLE_OLD" "$TABLE"
  decode_latency tablee2e_old 170 "$model"
  table_restore
  decode_latency tablee2e_new2 170 "$model"
}
stage_moejson() {  # the table's choice against named tuning overrides from a json file ($MOE_VARIANTS: {name: fields}) at
  # $MOE_TOKENS tokens of the $MOE_MODELS layers
  local v
  mapfile -t v < <(python3 -c "import json, sys; [print(f'--variant={k}={json.dumps(c)}') for k, c in json.load(open(sys.argv[1])).items()]" "$MOE_VARIANTS")
  run "moejson${MOE_TAG:-}" "${MOE_LIMIT:-480}" python3 benchmarks/moe_bench.py --models "${MOE_MODELS:-122B,397B,35B}" \
    --tokens "$MOE_TOKENS" --only '^auto$' --reps "${MOE_REPS:-10}" ${MOE_PROFILE:+--profile} "${v[@]}" --out "$OUT/moejson${MOE_TAG:-}.json"
}
# the same again, into moejsonb.*, or another set: $MOE_VARIANTS_B / $MOE_TOKENS_B / $MOE_MODELS_B where set
stage_moejsonb() {
  MOE_TAG=b MOE_VARIANTS=${MOE_VARIANTS_B:-$MOE_VARIANTS} MOE_TOKENS=${MOE_TOKENS_B:-$MOE_TOKENS} \
    MOE_MODELS=${MOE_MODELS_B:-${MOE_MODELS:-}} stage_moejson
}
stage_h200owed() {  # the H200 call owed since the forty-fourth session (docs/benchmarks.md, forty-seventh session's
  # "Still owed"): the table's choice; the table against itself without the 32-slot / split-32 entries or the cap;
  # the forty-fifth session's TMA entries against their predecessors; the forty-sixth session's fence change against
  # the kernels before it at 1-2 tokens (old side in .bench_assets/old); the stall profile. About 5 minutes
  local MOE_VARIANTS=docs/bench_results/2026-12-07e/h200_owed_variants.json MOE_MODELS=122B,397B,35B \
    MOE_TOKENS=448,512,576,720,800,896,1024,1280 MOE_VARIANTS_B=docs/bench_results/2026-12-07c/h200_variants.json \
    MOE_TOKENS_B=1,2,4,8,32,96,128,256,384,512 MOE_MODELS_B=122B,397B,35B AB_TOKENS=1,2 AB_MODELS=122B,397B
  stage_moeauto; stage_moejson; stage_moejsonb; stage_moeab; stage_ncustall
}
ab_tree() {  # a copy of this checkout at /tmp/abtree with the files under $1 (default $AB_OLD, else .bench_assets/old)
  # laid over it: the "before" side of an A/B timing of a kernel change, run in the same call as the "after" side;
  # rebuilt by every stage that uses it (a machine lent again may still hold an earlier call's tree)
  rm -rf /tmp/abtree && mkdir -p /tmp/abtree && tar cf - --exclude=./.bench_assets --exclude=./.whl --exclude=./.git --exclude=./.venv . | tar xf - -C /tmp/abtree \
    && cp -r "${1:-${AB_OLD:-.bench_assets/old}}/." /tmp/abtree/
}
ab_env() {  # $(ab_env new|old) CMD...: CMD in this checkout or in /tmp/abtree, that tree's nibble first on the path
  local dir=$PWD
  [ "$1" = old ] && dir=/tmp/abtree
  echo env -C "$dir" PYTHONPATH="/tmp/site:$dir"
}
stage_moeab() {  # the table's choice, this checkout against /tmp/abtree, alternately twice, at $AB_TOKENS of $AB_MODELS
  ab_tree || { echo "[moeab] no A/B tree" | tee -a "$SUMMARY"; return; }
  local r side
  for r in 1 2; do
    for side in new old; do
      run "moeab_${side}$r" "${MOE_LIMIT:-300}" $(ab_env $side) python3 benchmarks/moe_bench.py \
        --models "${AB_MODELS:-122B,397B}" --tokens "${AB_TOKENS:-$MOE_TOKENS}" --only '^auto$' --reps "${MOE_REPS:-10}" \
        --out "$OUT/moeab_${side}$r.json"
    done
  done
}
stage_linearab() {  # nvfp4_linear (and cuBLAS bf16), this checkout against /tmp/abtree, at $LIN_TOKENS
  ab_tree || { echo "[linearab] no A/B tree" | tee -a "$SUMMARY"; return; }
  local side
  for side in new old; do
    run "linearab_$side" 240 $(ab_env $side) python3 benchmarks/kernels.py --ops linear --models 122B,397B \
      --tokens "${LIN_TOKENS:-1,16,256,1024,2048,8192}" --budget-s 200 --out "$OUT/linearab_$side.json"
  done
}
stage_moeshards() {  # the table's choice on one rank's share of tensor- / expert-parallel layers (moe_bench.py `spec`)
  run moeshards 300 python3 benchmarks/moe_bench.py --models "${MOE_SHARDS:-122B/tp2,122B/tp4,397B/tp4,397B/tp8,397B/ep8}" \
    --tokens "${MOE_TOKENS:-1,4,16,64,256,1024,4096}" --only '^auto$' --out "$OUT/moeshards.json"
}
stage_gluonprobe() { run gluonprobe 150 python3 benchmarks/gluon_probe.py; }  # Gluon on this Triton: names, async-wgmma GEMM
stage_gluonfp4() {  # the register-operand Gluon GEMM on NVFP4 weights: dense against nvfp4_linear, then grouped
  # like the 122B-A10B's gate_up at 4096 tokens and at decode sizes (8 / 16 pairs per expert: 256 / 512 tokens)
  # beside the Triton gate_up's kernel time at those token counts (--profile)
  run gluonfp4 200 python3 benchmarks/gluon_fp4_probe.py
  run gluonfp4moe 200 python3 benchmarks/gluon_fp4_probe.py --experts 256 --m 128 --n 2048 --k 3072
  gluon_dec_probes
  run moeprof4096 200 python3 benchmarks/moe_bench.py --models 122B --tokens 256,512,4096 --only '^auto$' --profile \
    --out "$OUT/moeprof4096.json"
}
gluon_dec_probes() {  # the grouped Gluon GEMM at 8 and 16 pairs per expert (the 122B-A10B's gate_up at 256 / 512 tokens)
  run gluonfp4dec 150 python3 benchmarks/gluon_fp4_probe.py --experts 256 --m 8 --n 2048 --k 3072
  run gluonfp4dec16 150 python3 benchmarks/gluon_fp4_probe.py --experts 256 --m 16 --n 2048 --k 3072
}
stage_gluondec() {  # the Gluon GEMM at decode sizes, weights one or two K steps ahead, beside the Triton gate_up's time
  gluon_dec_probes
  run moeprofdec 120 python3 benchmarks/moe_bench.py --models 122B --tokens 256,512 --only '^auto$' --profile \
    --out "$OUT/moeprofdec.json"
}
stage_gluonsync() {  # the converter-decode Gluon GEMM with its wgmma waited for every step (SYNC 2) and with two steps
  # per loop iteration in different A registers (SYNC 16), checked (--check) and timed, dense and grouped like the
  # 122B-A10B's gate_up at 4096 tokens, beside the racy SYNC 0 and the Triton nvfp4_linear
  stage_gluoncheck
  local s
  for s in 16 2 0; do
    run "gluonsync$s" 120 python3 benchmarks/gluon_fp4_probe.py --sync "$s" --only 'converter'
    run "gluonsyncmoe$s" 120 python3 benchmarks/gluon_fp4_probe.py --experts 256 --m 128 --n 2048 --k 3072 --sync "$s"
  done
}
stage_gluoncheck() { run gluoncheck 300 python3 benchmarks/gluon_fp4_probe.py --check; }  # the wrong tiles, with each suspect's fix

stage_moe35dn() {  # 35B-A3B at 2-4 tokens: wider / one-step down tiles against the table (thirty-fourth session's dn_early hint)
  local r
  for r in 1 2; do
    run "moe35dn_r$r" 200 python3 benchmarks/moe_bench.py --models 35B --tokens 2,3,4 --only '^auto$' --reps 40 \
      --variant 'd64w4={"dn_block_n": 64, "dn_warps": 4}' --variant 'dk512={"dn_block_k": 512}' \
      --variant 'd64w4k512={"dn_block_n": 64, "dn_warps": 4, "dn_block_k": 512}' \
      --variant 'd64w4k512s2={"dn_block_n": 64, "dn_warps": 4, "dn_block_k": 512, "dn_stages": 2}' \
      --out "$OUT/moe35dn_r$r.json"
  done
}
stage_tablecheck() {  # 6-20 tokens: the table (per-pair path with 2 token slots) against the sorted quad-4 tile it replaced
  run tablecheck 200 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 6,9,14,16,20 --only '^auto$' --reps 40 \
    --variant 'srt={"path": "sorted", "xmode": "quad", "block_t": 4, "gu_block_n": 32, "gu_block_k": 256, "gu_warps": 4, "gu_stages": 4, "dn_mode": "reduce", "dn_block_n": 64, "dn_block_k": 256, "dn_warps": 4, "dn_stages": 3, "dn_prefetch": true}' \
    --out "$OUT/tablecheck.json"
}
stage_moewin() {  # winners of an earlier stage's moe_bench run ($OUT/$MOEWIN_FROM, moe_winners.py) put first in this GPU's
  # table: decode steps before, with them, before again. MOEWIN_FROM may also be a path in the checkout (an earlier
  # call's result brought along)
  local src=${MOEWIN_FROM:-moe.json} model=Qwen3.5-35B-A3B-NVFP4 n
  [ -f "$src" ] || src=$OUT/$src
  [ -f "$src" ] || { echo "[moewin] no $src" | tee -a "$SUMMARY"; return; }
  run moewin 60 python3 benchmarks/moe_winners.py "$src" --out "$OUT/moewin_entries.json"
  n=$(python3 -c "import json, sys; print(len(json.load(open(sys.argv[1]))))" "$OUT/moewin_entries.json" 2>/dev/null)
  [ "${n:-0}" -gt 0 ] || { echo "[moewin] no winners" | tee -a "$SUMMARY"; return; }
  python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory < 100 * 2**30)" \
    && model=Qwen3.5-122B-A10B-NVFP4
  table_save
  decode_latency moewin_before 170 $model
  run moewin_install 30 python3 benchmarks/install_tuning_entries.py fused_moe "$OUT/moewin_entries.json" --prepend
  cp "$TABLE" "$OUT/moewin_table.json"
  decode_latency moewin_with 170 $model
  table_restore
  decode_latency moewin_before2 170 $model
}
table_first_entry() {  # table_first_entry OP ENTRY_JSON: ENTRY becomes the first of OP's entries in this GPU's table
  echo "[$2]" > /tmp/table_entry.json
  python3 benchmarks/install_tuning_entries.py "$1" /tmp/table_entry.json --prepend > /dev/null
}
stage_moebte2e() {  # H100: 35B decode steps with the table, then with 2 token slots on the pairs path (its own table's overlay)
  table_save
  decode_latency moebte2e_on 120 Qwen3.5-35B-A3B-NVFP4
  table_first_entry fused_moe '{"when": {"max_tokens": 7}, "config": {"block_t": 2}}'
  decode_latency moebte2e_bt2 120 Qwen3.5-35B-A3B-NVFP4
  table_restore
}
stage_moedne2e() {  # 35B decode steps: the table, with the one-token top-k sum by a separate reduce launch, the table again
  local v entry
  # the whole one-token configuration this GPU takes for the 35B layer, with dn_mode "reduce", first in its own table
  entry=$(python3 -c "
import json
from nibble.kernels.tuning_tables import lookup
key = {'tokens': 1, 'fp4': True, 'hidden': 2048, 'inter': 512, 'experts': 256, 'top_k': 8, 'pairs_per_expert': 8 / 256}
cfg = {**lookup('fused_moe', 'cuda:0', key), 'dn_mode': 'reduce'}
print(json.dumps({'when': {'max_tokens': 1, 'max_hidden': 2048}, 'config': cfg}))")
  table_save
  for v in on reduce on2; do
    table_restore
    [ "$v" = reduce ] && table_first_entry fused_moe "$entry"
    decode_latency moedne2e_$v 170 Qwen3.5-35B-A3B-NVFP4
  done
  table_restore
}
stage_moe397() { run moe397 200 python3 benchmarks/moe_bench.py --models 397B --tokens 1,4,16,64,256,2048 --out "$OUT/moe397.json"; }
stage_ncu() {
  run ncu 100 ncu --clock-control none --kernel-name regex:moe_ --launch-skip 0 --launch-count 10 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    python3 benchmarks/moe_ncu.py --model 122B --tokens 1 --configs "[{}]"
}
stage_ncu1() {  # the T = 1 and T = 32 expert kernels in detail: stall reasons, pipes, memory, hot instructions
  for t in 1 32; do
    run ncu1_t$t 150 ncu --clock-control none --kernel-name regex:moe_w4 --launch-skip 0 --launch-count 4 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
      --print-details all --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 benchmarks/moe_ncu.py --model 122B --tokens $t --configs '[{}]'
  done
}
stage_ncudn() {  # the 122B layer's expert kernels at 128 and 256 tokens, where the H200 stays under 70% of copy bandwidth
  # (down is half of gate_up's bytes but two-thirds of its time): DRAM, occupancy, stalls; then each kernel's time
  local t
  for t in 128 256; do
    run ncudn_t$t 150 ncu --clock-control none --kernel-name regex:moe_w4 --launch-skip 0 --launch-count 8 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --section MemoryWorkloadAnalysis python3 benchmarks/moe_ncu.py --model 122B --tokens $t --configs '[{}]'
  done
  run moeprofdn 120 python3 benchmarks/moe_bench.py --models 122B,397B --tokens 96,128,192,256 --only '^auto$' --profile \
    --out "$OUT/moeprofdn.json"
}
stage_ncustall() {  # the 122B layer's expert kernels at 1 and 256 tokens: stall reasons per issued instruction and pipe use
  local t
  for t in 1 256; do
    run ncustall_t$t 120 ncu --clock-control none --kernel-name regex:moe_w4 --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section InstructionStats --print-details all \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 benchmarks/moe_ncu.py --model 122B --tokens $t --configs '[{}]'
  done
}
stage_pdlentrytests() {  # the MoE's first kernel and the router launched with PDL: bitwise the plain launches' outputs
  NIBBLE_TEST_GPU=1 run pdlentrytests 240 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "pdl or route" -p no:cacheprovider -rf
}
stage_moepdlentry() {  # the table's choice against `pdl_entry` on and off (the MoE's first kernel starts early too,
  # down / the reduce let the next layer's start) at 1-16 tokens of the three layers; with PDLENTRY_TWICE, again
  local f=$OUT/pdl_entry_variants.json
  echo '{"pdlentry": {"pdl_entry": true}, "nopdlentry": {"pdl_entry": false}}' > "$f"
  MOE_VARIANTS=$f MOE_TOKENS=1,2,3,4,6,8,12,16 MOE_MODELS=122B,397B,35B MOE_LIMIT=240 stage_moejson
  [ -n "${PDLENTRY_TWICE:-}" ] && MOE_VARIANTS_B=$f MOE_TOKENS_B=1,2,3,4,6,8,12,16 MOE_MODELS_B=122B,397B,35B \
    MOE_LIMIT=240 stage_moejsonb
}
pdl_entry_all() {  # pdl_entry_all true|false: `pdl_entry` (fused_moe) and the router's `pdl` in every entry of
  # every table (default.json and the device tables, which set them too), so that neither side depends on a table
  python3 -c "
import json, pathlib, sys
on = sys.argv[1] == 'true'
for p in pathlib.Path('nibble/kernels/tuning').glob('*.json'):
    d = json.loads(p.read_text())
    if 'fused_moe' not in d and 'route' not in d:
        continue
    for e in d.get('fused_moe', []):
        e['config']['pdl_entry'] = on
    for e in d.get('route', []):
        e['config']['pdl'] = on
    p.write_text(json.dumps(d, indent=1) + '\n')" "$1"
}
stage_pdlentrye2e() {  # $TABLE_MODEL (default 35B) decode steps without, with, without the router / MoE entry PDL
  local model=${TABLE_MODEL:-Qwen3.5-35B-A3B-NVFP4}
  rm -rf /tmp/tuning_saved && cp -r nibble/kernels/tuning /tmp/tuning_saved
  pdl_entry_all false
  decode_latency pdlentrye2e_off 170 "$model"
  pdl_entry_all true
  decode_latency pdlentrye2e_on 170 "$model"
  pdl_entry_all false
  decode_latency pdlentrye2e_off2 170 "$model"
  rm -rf nibble/kernels/tuning && cp -r /tmp/tuning_saved nibble/kernels/tuning
}
entry_set() {  # lay $ENTRY_SET (JSON fields) over the config of entry $ENTRY_INDEX of this GPU's fused_moe table
  python3 -c "
import json, sys
path, i, fields = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
d = json.load(open(path))
d['fused_moe'][i]['config'].update(fields)
open(path, 'w').write(json.dumps(d, indent=1) + '\\n')
print('entry', i, d['fused_moe'][i]['when'], '->', d['fused_moe'][i]['config'])" "$TABLE" "$ENTRY_INDEX" "$ENTRY_SET"
}
stage_entrye2e() {  # $TABLE_MODEL (default 35B) decode steps with this GPU's table, then with $ENTRY_SET laid over
  # its fused_moe entry $ENTRY_INDEX, twice in turn (the decode steps chain the router before the MoE, as
  # moe_bench's `with_route` variants do)
  local model=${TABLE_MODEL:-Qwen3.5-35B-A3B-NVFP4}
  table_save
  for round in 1 2; do
    decode_latency "entrye2e_table$round" 170 "$model"
    entry_set >> "$SUMMARY"
    decode_latency "entrye2e_set$round" 170 "$model"
    table_restore
  done
}
stage_routebound() {  # $TABLE_MODEL (default 35B) decode steps as they are, then with the router's kernel left out of
  # the captured graphs (benchmarks/route_bound.py: the bound on what fusing the router away can gain), twice in turn
  local model=${TABLE_MODEL:-Qwen3.5-35B-A3B-NVFP4}
  for round in 1 2; do
    decode_latency "routebound_route$round" 170 "$model"
    run "routebound_none$round" 170 python3 benchmarks/route_bound.py --model "$M/$model" --load-format dummy \
      --batch-sizes 1,4,8 --input-len 1024 --output-len 64 --max-num-seqs 8 --output-json "$OUT/routebound_none$round.json"
  done
}
stage_aligntests() {
  NIBBLE_TEST_GPU=1 run "aligntests${ALIGN_TAG:-}" 120 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k align -p no:cacheprovider -rf
}
stage_alignab() {  # the table's choice with this checkout's moe_align, with $ALIGN_OLD's (an earlier moe_align.py brought
  # along, e.g. `git show 56aee14:nibble/kernels/moe_align.py > out/moe_align_before.py`, carry out/), with this one
  # again; per-kernel times (--profile) at $ALIGN_TOKENS of the 122B and 397B layers; file names tagged $ALIGN_TAG
  local tag
  stage_aligntests
  rm -rf /tmp/align_old && mkdir -p /tmp/align_old/nibble/kernels && cp "$ALIGN_OLD" /tmp/align_old/nibble/kernels/moe_align.py \
    && ab_tree /tmp/align_old || { echo "[alignab] no A/B tree" | tee -a "$SUMMARY"; return; }
  for tag in new old new2; do
    run "alignab${ALIGN_TAG:-}_$tag" 200 $(ab_env $tag) python3 benchmarks/moe_bench.py --models 122B,397B \
      --tokens "${ALIGN_TOKENS:-32,128,256,512,1024,4096}" --only '^auto$' --profile --out "$OUT/alignab${ALIGN_TAG:-}_$tag.json"
  done
}
stage_attntests() { NIBBLE_TEST_GPU=1 run attntests 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "attention or store_kv or select_kernels" -p no:cacheprovider -rf; }
stage_routelin() { NIBBLE_TEST_GPU=1 run routelin 280 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "route or nvfp4_linear or select" -p no:cacheprovider -rf --tb=short; }
stage_kernels() { run kernels 300 python3 benchmarks/kernels.py --quick --out "$OUT/kernels.json" --md "$OUT/kernels.md"; }
stage_kernels_std() { run kernels_std 400 python3 benchmarks/kernels.py --budget-s 370 --out "$OUT/kernels.json" --md "$OUT/kernels.md"; }
stage_kernels_full() { run kernels_full 480 python3 benchmarks/kernels.py --out "$OUT/kernels.json" --md "$OUT/kernels.md"; }
stage_doctor() { run doctor 240 python3 -m nibble.cli doctor --model $M/Qwen3.5-122B-A10B-NVFP4 --json; }
stage_latency35() {
  run latency35 300 python3 -m nibble.cli bench latency --model $M/Qwen3.5-35B-A3B-NVFP4 --load-format dummy \
    --batch-sizes 1,8,32 --input-len 1024 --output-len 64 --output-json "$OUT/latency35.json"
}
stage_latency122() {
  run latency122 170 python3 -m nibble.cli bench latency --model $M/Qwen3.5-122B-A10B-NVFP4 --load-format dummy \
    --batch-sizes 1,8,32,128 --input-len 1024 --output-len 64 --max-num-seqs 128 --output-json "$OUT/latency122.json"
}
stage_sharedoverlap() {  # 122B decode steps with the shared expert on its own stream (default), inline, and on its own again
  for v in on off on2; do
    local flag=""; [ "$v" = off ] && flag="--no-shared-expert-overlap"
    run sharedoverlap_$v 200 python3 -m nibble.cli bench latency --model $M/Qwen3.5-122B-A10B-NVFP4 --load-format dummy \
      --batch-sizes 1,8,32 --input-len 1024 --output-len 64 --max-num-seqs 32 $flag --output-json "$OUT/sharedoverlap_$v.json"
  done
}
stage_throughput35() {  # offline throughput, all prompts at once (`nibble bench throughput`), 35B-A3B dummy weights
  run throughput35 240 python3 -m nibble.cli bench throughput --model $M/Qwen3.5-35B-A3B-NVFP4 --load-format dummy \
    --tokenizer .bench_assets --num-prompts 256 --input-len 512 --output-len 256 --max-model-len 1024 --disable-tqdm \
    --output-json "$OUT/throughput35.json"
}

stage_tmae2e() {  # end-to-end prefill and decode of the 122B layer stack with the table's TMA fields, without them
  # (every gu_tma / dn_tma zeroed in the working copy of the table), and with them again; second iteration reported
  local t=nibble/kernels/tuning/nvidia_h200.json
  cp $t /tmp/table_tma.json
  for v in on off on2; do
    if [ $v = off ]; then
      python3 -c "import json, re; p='$t'; s=open(p).read(); open(p, 'w').write(re.sub(r'(\"(lg_)?(gu|dn)_tma\": )[0-9]', r'\g<1>0', s))"
      grep -c '_tma": [12]' $t | sed 's/^/tma fields left on: /' >> "$SUMMARY"
    else
      cp /tmp/table_tma.json $t
    fi
    run "tmae2e_$v" 200 python3 -m nibble.cli bench latency --model $M/Qwen3.5-122B-A10B-NVFP4 --load-format dummy \
      --batch-sizes 1,8 --input-len 1024 --output-len 16 --num-iters 2 --output-json "$OUT/tmae2e_$v.json"
  done
  cp /tmp/table_tma.json $t
}

stage_asynce2e() {  # 122B decode steps with overlapped scheduling (default), without it, and with it again
  for v in on off on2; do
    local flag=""
    [ $v = off ] && flag="--no-async-scheduling"
    run "asynce2e_$v" 200 python3 -m nibble.cli bench latency --model $M/Qwen3.5-122B-A10B-NVFP4 --load-format dummy \
      --batch-sizes 1,8,32,128 --input-len 1024 --output-len 64 --max-num-seqs 128 $flag --output-json "$OUT/asynce2e_$v.json"
  done
}

stage_compiletrace() {  # Triton compilations per request burst (random prompt lengths), no warm-up burst
  run compiletrace 300 env TRITON_PRINT_AUTOTUNING=1 python3 benchmarks/ttft_probe.py --model $M/Qwen3.5-122B-A10B-NVFP4 \
    --bursts 8,32,32 --modes on --random-lens --no-warm-burst --trace-compiles --output-len 16 --out "$OUT/compiletrace.json"
}
stage_abgdn() {  # decode steps, working tree against old_src.tgz (`git archive <commit> nibble | gzip`), new/old/new
  local root=$PWD
  rm -rf /tmp/old && mkdir -p /tmp/old && tar xzf old_src.tgz -C /tmp/old || return
  for model in ${AB_MODELS:-122B-A10B 35B-A3B}; do
    for v in new old new2; do
      local dir=$root; [ $v = old ] && dir=/tmp/old
      (cd $dir && run ab_${model}_$v 240 env PYTHONPATH=/tmp/site:$dir python3 -m nibble.cli bench latency \
        --model $root/$M/Qwen3.5-$model-NVFP4 --load-format dummy --batch-sizes 1,8,32 --input-len 256 \
        --output-len 64 --max-num-seqs 32 --output-json "$OUT/ab_${model}_$v.json")
    done
  done
}
stage_structured() {  # decode step cost of JSON-schema requests against free ones (overlap on / off), 35B-A3B
  run structured 300 python3 benchmarks/structured_bench.py --model $M/Qwen3.5-35B-A3B-NVFP4 --tokenizer .bench_assets \
    --batches 1,8,32 --out "$OUT/structured.json"
}
stage_prefixcache() {  # TTFT with a shared prefix cached / computed, 122B-A10B dummy weights
  run prefixcache 440 python3 benchmarks/prefix_cache_bench.py --model $M/Qwen3.5-122B-A10B-NVFP4 --load-format dummy \
    --shared 1024,4096,16384 --out "$OUT/prefixcache.json"
}
stage_spectests() { NIBBLE_TEST_GPU=1 run spectests 300 python3 -m pytest -q tests/gpu/test_spec_decode_gpu.py tests/gpu/test_attention_verify_gpu.py tests/gpu/test_kernels_gpu.py -k "spec or verify or graphs_match" -p no:cacheprovider -rf; }
stage_specdecode() {  # decode with MTP drafts (own, and acceptance forced at 1.0/0.8/0.6), 122B-A10B dummy weights
  run specdecode 560 python3 benchmarks/spec_decode_bench.py --model $M/Qwen3.5-122B-A10B-NVFP4 --load-format dummy \
    --ks ${SPEC_KS:-0,1,3} --batches ${SPEC_BATCHES:-1,8,32} --alphas ${SPEC_ALPHAS:-1.0,0.8,0.6} --out "$OUT/specdecode.json"
}
stage_specngram() {  # decode with n-gram drafts (own, and acceptance forced at 1.0/0.6) against plain, 122B-A10B dummy weights
  run specngram 560 python3 benchmarks/spec_decode_bench.py --model $M/Qwen3.5-122B-A10B-NVFP4 --load-format dummy \
    --method ngram --ks ${SPEC_KS:-0,3} --batches ${SPEC_BATCHES:-1,8,32} --alphas ${SPEC_ALPHAS:-1.0,0.6} \
    --out "$OUT/specngram.json"
}
stage_visiontests() { NIBBLE_TEST_GPU=1 run visiontests 300 python3 -m pytest -q -s tests/gpu/test_vision_gpu.py -p no:cacheprovider -rf; }
stage_padtests() {  # graph padding routed to no expert: decode, mixed-step and verify graphs against eager steps, route
  NIBBLE_TEST_GPU=1 run padtests 300 python3 -m pytest -q tests/gpu/test_engine_gpu.py tests/gpu/test_spec_decode_gpu.py \
    tests/gpu/test_kernels_gpu.py -k "padded_decode or mixed_step or verify_graphs or test_route" -p no:cacheprovider -rf
}
stage_mixedtests() { NIBBLE_TEST_GPU=1 run mixedtests 300 python3 -m pytest -q tests/gpu/test_engine_gpu.py -k mixed -p no:cacheprovider -rf; }
stage_mixedbench() {  # short prefills / arrivals next to decoding requests: mixed-step CUDA graphs against eager steps
  run mixedbench 420 python3 benchmarks/mixed_graphs_bench.py --model $M/Qwen3.5-122B-A10B-NVFP4 --out "$OUT/mixedbench.json"
}
stage_longctx() {  # YaRN past the pretraining length: a 300k-token prompt on the 35B, two prefill chunkings agree
  run longctx 560 python3 benchmarks/long_context_bench.py --model $M/Qwen3.5-35B-A3B-NVFP4 --length 300000 \
    --out "$OUT/longctx.json"
}
# paged attention against an older kernel where .bench_assets/paged_attention_old.py holds one, e.g.
#   git show 5d9ee40:nibble/kernels/paged_attention.py > .bench_assets/paged_attention_old.py
attn_baseline() { [ -f .bench_assets/paged_attention_old.py ] && echo "--baseline .bench_assets/paged_attention_old.py"; }
stage_attnprefill() {  # paged-attention prefill tiles at the 122B / 35B shapes
  run attnprefill 420 python3 benchmarks/attention_prefill_bench.py $(attn_baseline) --out "$OUT/attnprefill.json"
}
stage_attngather() {  # FP8 prefills through the 16-bit scratch cache (fp8_gather) and converting in the kernel
  run attngather 300 python3 benchmarks/attention_prefill_bench.py --models 122B,35B --sweep "" --no-decode --fp8-gather \
    --cases "${ATTN_CASES:-512:0,1024:0,2048:0,8192:0,256:32768,1024:16384,2048:30720,8192:57344}" --out "$OUT/attngather.json"
}
stage_gathere2e() {  # 35B-A3B, one 64k-token prompt with an FP8 KV cache: TTFT with fp8_gather on, off, on again
  # (set in every paged_attention entry of the H200's table, which an H100 takes too)
  local t=nibble/kernels/tuning/nvidia_h200.json v
  cp "$t" /tmp/h200_table_saved.json
  for v in on off on2; do
    python3 -c "
import json, sys
t = json.load(open(sys.argv[1]))
for e in t['paged_attention']:
    e['config']['fp8_gather'] = sys.argv[3] != 'off'
json.dump(t, open(sys.argv[2], 'w'), indent=1)" /tmp/h200_table_saved.json "$t" "$v"
    run "gathere2e_$v" 200 python3 benchmarks/long_context_bench.py --model $M/Qwen3.5-35B-A3B-NVFP4 --length 65536 \
      --chunks 8192 --kv-cache-dtype fp8 --decode-steps 8 --out "$OUT/gathere2e_$v.json"
  done
  cp /tmp/h200_table_saved.json "$t"
}
stage_attndecode() {  # the table's prefill tile against the old kernel, and decode / verify with and without the unmasked loop
  run attndecode 300 python3 benchmarks/attention_prefill_bench.py $(attn_baseline) --sweep "" --out "$OUT/attndecode.json"
}
stage_prefillhost() {  # short eager prefills: wall vs kernel time, fla's chunked delta rule vs the recurrent one
  run prefillhost 400 python3 benchmarks/prefill_host_probe.py --model $M/Qwen3.5-122B-A10B-NVFP4 --out "$OUT/prefillhost"
}
stage_ttft() {  # TTFT of request bursts through LLMEngine itself, overlapped scheduling on / off / on
  run ttft 200 python3 benchmarks/ttft_probe.py --model $M/Qwen3.5-122B-A10B-NVFP4 --bursts 1,8,32 --out "$OUT/ttft.json"
}

stage_profile35b1() { profile_b1 profile35b1 Qwen3.5-35B-A3B-NVFP4; }
stage_profile35() {
  run profile35 260 python3 benchmarks/profile_decode.py --model $M/Qwen3.5-35B-A3B-NVFP4 --out "$OUT/profile35"
}
stage_profile122() {
  run profile122 300 python3 benchmarks/profile_decode.py --model $M/Qwen3.5-122B-A10B-NVFP4 --out "$OUT/profile122"
}

serve_and_bench() {  # serve_and_bench NAME MODEL_DIR SWEEP PROMPTS_PER_CONC WAIT_S BENCH_S EXTRA_SERVE_ARGS...
  local name=$1 model=$2 sweep=$3 ppc=$4 wait_s=$5 bench_s=$6; shift 6
  python3 -m nibble.cli serve --model "$model" --load-format dummy --tokenizer .bench_assets --port 8011 \
    --max-model-len 4096 "$@" > "$OUT/serve_$name.log" 2>&1 &
  local pid=$!
  local t0=$SECONDS
  until curl -sf http://127.0.0.1:8011/health > /dev/null; do
    if ! kill -0 $pid 2>/dev/null || [ $((SECONDS - t0)) -gt "$wait_s" ]; then
      echo "[serve_$name] server did not come up" | tee -a "$SUMMARY"; tail -n 30 "$OUT/serve_$name.log" >> "$SUMMARY"
      kill $pid 2>/dev/null; return
    fi
    sleep 2
  done
  echo "[serve_$name] up after $((SECONDS - t0))s" | tee -a "$SUMMARY"
  run "bench_$name" "$bench_s" python3 -m nibble.cli bench serve --base-url http://127.0.0.1:8011 --tokenizer .bench_assets \
    --prompt-token-ids --random-input-len 1024 --random-output-len 1024 --concurrency-sweep "$sweep" \
    --prompts-per-concurrency "$ppc" --num-warmups 0 --disable-tqdm --save-result --result-dir "$OUT" \
    --result-filename "bench_$name.json" --plot "$OUT/bench_$name.png"
  kill -INT $pid; sleep 3; kill -9 $pid 2>/dev/null
  grep -E "kernels:|self-test|engine ready|captured|warm-up|CUDA graphs for .* ready" "$OUT/serve_$name.log" >> "$SUMMARY"
  pack
}
stage_serve122() { serve_and_bench 122 $M/Qwen3.5-122B-A10B-NVFP4 1,8,32,128 1 120 230 --max-num-seqs 128; }
stage_serve122sync() { serve_and_bench 122sync $M/Qwen3.5-122B-A10B-NVFP4 1,8,32 1 120 150 --max-num-seqs 128 --no-async-scheduling; }
stage_serve122c8() { serve_and_bench 122c8 $M/Qwen3.5-122B-A10B-NVFP4 8 1 120 60 --max-num-seqs 128; }
stage_serve122c8sync() { serve_and_bench 122c8sync $M/Qwen3.5-122B-A10B-NVFP4 8 1 120 60 --max-num-seqs 128 --no-async-scheduling; }
stage_serve122first() { serve_and_bench 122first $M/Qwen3.5-122B-A10B-NVFP4 8,32 1 300 90 --max-num-seqs 128; }
stage_serve35() { serve_and_bench 35 $M/Qwen3.5-35B-A3B-NVFP4 1,8,32,128 1 80 130 --max-num-seqs 128; }
stage_serve35c128() { serve_and_bench 35c128 $M/Qwen3.5-35B-A3B-NVFP4 128 1 35 60 --max-num-seqs 128; }
stage_peer35() {
  run peer35 120 python3 benchmarks/transformers_peer.py --model $M/Qwen3.5-35B-A3B --batch-sizes 1,8 \
    --input-len 1024 --output-len 64 --out "$OUT/peer35.json"
}

for s in "$@"; do "stage_$s"; done
pack
echo "=== summary"; cat "$SUMMARY"

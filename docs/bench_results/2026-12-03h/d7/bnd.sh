export PYTHONPATH=$PWD
G='{"path":"gemv","xmode":"quad","block_t":4,"gu_block_n":16,"gu_block_k":256,"gu_warps":2,"gu_stages":4,"dn_mode":"reduce","dn_block_n":32,"dn_block_k":256,"dn_warps":2,"dn_stages":3,"dn_prefetch":false}'
GP='{"path":"gemv","xmode":"quad","block_t":4,"gu_block_n":16,"gu_block_k":256,"gu_warps":2,"gu_stages":4,"dn_mode":"reduce","dn_block_n":32,"dn_block_k":256,"dn_warps":2,"dn_stages":3,"dn_prefetch":true}'
S='{"path":"sorted","xmode":"quad","block_t":4,"gu_block_n":32,"gu_block_k":256,"gu_warps":4,"gu_stages":4,"dn_mode":"reduce","dn_block_n":64,"dn_block_k":256,"dn_warps":4,"dn_stages":3,"dn_prefetch":true}'
for r in 1 2; do timeout 100 python3 benchmarks/moe_bench.py --models 122B,397B,35B --tokens 5,6,7,8,10,12 --only '^auto$' --variant "gemv=$G" --variant "gemv-pf=$GP" --variant "sorted=$S" --out $OUT/bnd_r$r.json > $OUT/bnd_r$r.log 2>&1; echo r$r rc=$? $SECONDS s; done

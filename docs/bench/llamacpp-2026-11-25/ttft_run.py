# rag-promptcache bench --quick --threads 2 --scenarios ttft --contexts 2048, with fewer repeats (a loaded, shared machine)
import dataclasses, sys, torch
torch.set_num_threads(2)
from rag_promptcache.bench import run
from rag_promptcache.bench.common import BenchConfig
cfg = dataclasses.replace(BenchConfig.quick(), contexts=(2048,), repeats_slow=1, repeats_fast=3)
run(quick=True, json_path=sys.argv[1] + "/ttft.json", plots_dir=sys.argv[1] + "/ttft", config=cfg, scenarios=("ttft",))

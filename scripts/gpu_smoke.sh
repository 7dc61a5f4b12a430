#!/usr/bin/env bash
# A short smoke test of the CUDA training path, for a machine with one GPU:
#   bash scripts/gpu_smoke.sh [OUT]
# One GPU holds one worker (NCCL allows one rank per GPU), so it trains P=1, S=1 on cuda with the
# NCCL backend: training, evaluation, a checkpoint and a resume, the eager optimizer state and a
# group average (weights, gradients, AdamW state and the consensus distance) through a one-rank
# NCCL communicator, profiling, and the store's binding. It does not exercise p2p or multi-rank
# NCCL collectives: that needs several GPUs.
set -euo pipefail
OUT=${1:-${OUT:-/tmp/gpu_smoke}}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

ONE="cluster.device=cuda cluster.pipelines=1 pipeline.stages=1"
python3 -m sdpipe_cli train $ONE train.steps=60 train.eval_every=20 checkpoint.every=30 \
    checkpoint.on_exit=true run.dir="$OUT/run" &
launcher=$!
sleep 8  # while it runs: who listens where (the store in the launcher, NCCL's bootstrap)
python3 - "$launcher" <<'EOF'
import sys, psutil
root = psutil.Process(int(sys.argv[1]))
for p in [root, *root.children(recursive=True)]:
    try:
        ips = sorted({c.laddr.ip for c in p.net_connections("inet") if c.status == "LISTEN"})
        print("listening:", p.pid, " ".join(p.cmdline()[-1:]), ips)
    except psutil.Error:
        pass
EOF
wait "$launcher"
python3 -m sdpipe_cli resume "$OUT/run" train.steps=80
grep -c '"kind": "train"' "$OUT/run/metrics.jsonl"
tail -n 3 "$OUT/run/metrics.jsonl"

python3 - <<'EOF'
import os, datetime, torch, torch.distributed as dist
from omegaconf import OmegaConf
from sdpipe_cli.model import optim
from sdpipe_cli.sync.groups import GroupCache, average_tensors
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30))
dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
cfg = OmegaConf.create({"train": {"optimizer": "adamw", "lr": 1e-3, "momentum": 0.9,
                                  "weight_decay": 0.0}})
model = torch.nn.Linear(512, 512).cuda()
opt = optim.build_optimizer(model.parameters(), cfg.train)
model(torch.randn(64, 512, device="cuda")).pow(2).mean().backward()
opt.step()
params = list(model.parameters())
tensors = params + [p.grad for p in params] + optim.state_tensors(opt, params)
before = [t.detach().clone() for t in tensors]
distance = average_tensors(tensors, GroupCache(store, 0, "nccl", 30), [0], consensus=len(params))
assert all(torch.equal(a, b) for a, b in zip(before, tensors)), "a one-member average changed a tensor"
print("one-rank NCCL group average over", len(tensors), "tensors (devices:",
      sorted({str(t.device) for t in tensors}), ") consensus", distance)
dist.destroy_process_group()
EOF

python3 -m sdpipe_cli profile $ONE run.dir="$OUT/profile"
echo "gpu smoke: ok"

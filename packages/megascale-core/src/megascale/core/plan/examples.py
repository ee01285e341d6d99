"""`megascale plan`'s examples, which `megascale --help` also shows (a module of its own: no torch to import)."""

EXAMPLES = """\
  megascale plan --model llama3-8b --gpus 16 --global-batch 64 --seq-len 4096     # a preset, default --gpu h100
  megascale plan --model config.json --gpus 64 --gpu a100 --global-batch 512 --tp 8 --pp 2   # parts fixed
  megascale plan --hidden 4096 --layers 32 --heads 32 --vocab 32000 --gpus 16 --global-batch 64
  megascale plan --model llama3-8b --gpus 16 --global-batch 64 --emit-config run.yaml --cpu-trial trial.yaml
  megascale plan --calibrate                                                  # this machine's figures"""

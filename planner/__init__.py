"""Throughput and memory planner for PTD-P layouts (tools/plan.py is its command line).

- `cluster`: cluster specs (GPU, node, network, calibrated efficiency constants) from configs/clusters/*.yaml.
- parameters and FLOPs come from model/shape.py (the model's shape, declared once).
- `activations`: activation bytes per layer (the paper's and Korthikanti et al.'s formulas).
- `memory`: bytes per GPU: params, grads, optimizer state, in-flight activations from the schedule lists.
- `collectives`: every collective and send/receive a layout issues per rank and iteration (what the trainer
  issues: tests/planner/test_collectives.py compares them exactly); `software`: what the training program does
  that the config does not say (this trainer, or Megatron-LM 2021 for the paper's rows).
- `costs`: time of one layer chunk (GEMMs on an efficiency curve, memory-bound kernels) and of each listed
  collective, batch of pipeline messages and the optimizer step.
- `predict`: one layout -> iteration time, TFLOP/s per GPU, memory and breakdown; the pipeline part is the
  simulator (parallel/pipeline/simulator.py) run over the real action lists and the executor's plan of
  message batches, with these costs.
- `search`, `calibrate`, `plots`: ranking layouts (extrapolations marked, ranked conservatively), fitting the
  efficiency constants to runs, the sweeps.
- `published`, `paper_figures`, `fit_report`: the paper's Tables 1-2 at its schedule, its figures' effects as
  held-out checks, and the fit report (in-sample and leave-half-out errors).
"""

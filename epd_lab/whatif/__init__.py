"""What-if model of EPD serving: a SimPy discrete-event model calibrated from this project's own bench records.

`calibration` fits per-stage costs from `bench serve` results into a small JSON per machine; `model` simulates a
cluster (encoders, prefills, decodes or the monolithic floor, placed on devices, joined by links); `run` predicts
`bench serve` / `sweep rates` results with the same keys and compares them with measured ones. `epd-lab whatif`
is the command line (`cli`). docs/whatif.md describes the model, its assumptions and its measured error.
"""
from epd_lab.whatif.calibration import Calibration, Link, fit, read_point
from epd_lab.whatif.model import Cluster, SimRequest, simulate
from epd_lab.whatif.run import compare, predict, predict_sweep, workload

__all__ = ["Calibration", "Cluster", "Link", "SimRequest", "compare", "fit", "predict", "predict_sweep",
           "read_point", "simulate", "workload"]

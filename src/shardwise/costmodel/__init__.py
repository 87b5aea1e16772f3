"""Predicted step time, memory, MFU and scaling of a parallel plan (``predict``), with model
shapes, hardware presets (``hardware``) and plan search (``rank_plans``)."""

from shardwise.costmodel.hardware import Hardware, hardware, measured
from shardwise.costmodel.plan import Plan
from shardwise.costmodel.predict import Prediction, predict, ring_seconds
from shardwise.costmodel.shapes import ModelShape, shape

__all__ = [
    "Hardware",
    "ModelShape",
    "Plan",
    "Prediction",
    "hardware",
    "measured",
    "predict",
    "ring_seconds",
    "shape",
]

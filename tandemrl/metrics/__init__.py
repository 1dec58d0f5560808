"""Metric logging (TensorBoard, console) and plots."""

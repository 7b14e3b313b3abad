"""Synchronizers: how a mode turns local gradients into the update every rank applies.

One module per mode (bsp.py, ssp.py, easgd.py). A synchronizer is called by the strategy, in a
replica context, with the gradients Keras' optimizer is about to apply, and returns the
gradients to apply instead.
"""

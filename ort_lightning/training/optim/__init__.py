"""Optimizers and learning-rate schedules of an ORT fit.

``configure`` (what ``configure_optimizers`` returns), ``ort_optimizer`` (torch-shaped facades
over ORT's optimizer and linear scheduler), ``hybrid`` (a torch optimizer updating what ORT
computed), ``schedules`` (which schedule drives the ORT optimizer), ``graph_schedule`` (an
optimizer graph that computes its own learning rate).
"""

"""The CI check of formulas against measurement: validation cases, memplan's predictions for them, and running the torch
harness (validation/ in a checkout, memplan_validation in a wheel) to measure them."""

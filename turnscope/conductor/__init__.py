"""The conductor: the settings, and the runs that put serving, loadgen and the store together (eval,
calibration, capacity, the sweep); under the commands (docs/design.md)."""

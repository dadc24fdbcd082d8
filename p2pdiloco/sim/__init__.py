"""`p2pdiloco simulate`: a discrete-event model of a swarm of N learners (no network, no torch).

`scenario.py` (the settings and presets), `swarm.py` (decoupled and synchronous DiLoCo as p2pdiloco implements
them), `data_parallel.py` (lockstep data-parallel, restarted or elastic), `simulate.py` (one run of every
algorithm, sweeps), `calibrate.py` (a real bench folder against its simulation), `report.py` (text and plots).
See docs/simulation.md.
"""

"""`p2pdiloco simulate`: a discrete-event model of a swarm of N learners (no network, no torch).

`scenario.py` (the settings, their protocol defaults read from the shipped config), `presets.py`, `decoupled.py`
(decoupled DiLoCo as shipped, event by event), `groups.py` (groups dealt per epoch, merge and agreement costs, the
learners' global models and consensus), `swarm.py` (synchronous DiLoCo, and the ledger both produce),
`data_parallel.py` (lockstep data-parallel, restarted or elastic), `simulate.py` (one run of every algorithm, sweeps), `calibrate.py` (a real bench folder against its simulation), `report.py` (text and plots).
See docs/simulation.md.
"""

"""Selection: which drafter, and how many draft tokens (gamma), each slot uses at a step.

policy.py is what the engine sees (Policy, Choice, Outcome, StepCosts); factory.py turns the job's
selector into a policy; the SPIN bandit is bandit.py, built on costs.py (the cost model), joint.py
(the joint choice by goodput) and gate.py (the back-off step gate); fixed.py holds the policies
that run what they are told. How the bandit chooses: docs/selection.md.
"""

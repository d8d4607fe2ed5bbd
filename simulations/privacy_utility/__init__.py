"""The privacy-utility benchmark (issue 12): `python -m simulations.privacy_utility`."""

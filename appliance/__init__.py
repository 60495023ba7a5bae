"""appliance: offline on-prem training and edge deployment in one verified bundle."""

__version__ = "0.1.0"

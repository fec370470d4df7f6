"""The product: one module (or small package) per op family: its kernels, launchers, autograd
Function and reference. It imports only runtime, quant and other ops' public names
(tests/test_layering.py); test and bench cases live in tritonformer.cases."""

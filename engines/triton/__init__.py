"""The Triton model package: serving parameters, the model-repository renderer and ``model.py``.

``model.py`` is the Triton Python-backend model (copied into the repository as
``<model>/1/model.py``); it imports ``engines.*`` from the kvgate package installed in the
Triton image, so the request parsing is the very module the reference engine uses.
"""

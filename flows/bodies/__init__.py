"""The stages' bodies, one module per stage (finetune: both finetune stages): what each
stage computes, its inputs and hand-off, and its `Stage` declaration. They import only the
shared vocabulary (flows/stage.py) and the tasks they run, never each other, so dvc.yaml can
list for each stage exactly the code it runs."""

"""What the model families share: attention and its masks for packed documents (`attention`) and the
parameter initialisation that gives every parallel layout the same weights (`init`). A family's own
modules live in `models/<name>/`."""

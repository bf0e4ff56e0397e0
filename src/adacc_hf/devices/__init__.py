"""Planning for a device this machine does not have: its committed table (`table`), a roofline
over each op (`roofline`), a training step run without its arithmetic on the device's modelled
clock (`dryrun`), and the plan and step time that come out (`plan`)."""

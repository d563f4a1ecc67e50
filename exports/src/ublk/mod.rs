//! ublk export: a udm device as a Linux block device, `/dev/ublkbN`.

pub mod sys;

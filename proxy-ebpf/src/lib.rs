// Empty: lets the agent list this crate as a build dependency if it wants to.
#![no_std]

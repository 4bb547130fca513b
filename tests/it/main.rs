mod gate;
mod report;

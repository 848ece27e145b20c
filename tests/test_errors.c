#include "harness.h"
#include <stdio.h>
int main(int argc, char** argv) { h_init(argc, argv, "test_errors"); return h_finish(); }

#include "harness.h"
#include <stdio.h>
int main(int argc, char** argv) { h_init(argc, argv, "test_api"); return h_finish(); }

// octet serve (being written).
#pragma once
